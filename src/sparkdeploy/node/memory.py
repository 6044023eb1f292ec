"""The memory a node's GPUs can use, as the node reports it (``helpers/memory_node.py``): on a
discrete GPU nvidia-smi's own figures, on a unified-memory GPU (a DGX Spark's GB10, whose
nvidia-smi shows ``[N/A]``) the operating system's ``/proc/meminfo``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import run_helper

HELPER = "memory_node.py"
ARGS = ["read"]
GIB = 1024 ** 3


class NodeMemory(BaseModel):
    """The helper's answer: per GPU, bytes in all and usable now (None when not read: ``why``)."""

    model_config = ConfigDict(extra="ignore")
    gpus: int = Field(ge=0)
    names: list[str] = []
    unified: bool
    gpu_total: int | None = Field(default=None, ge=0)
    gpu_usable: int | None = Field(default=None, ge=0)
    gpu_free: int | None = Field(default=None, ge=0)
    """CUDA's own free figure where it differs (unified memory: ``MemFree``, the page cache
    counted as used)."""
    source: str = ""
    why: str = ""

    def line(self) -> str:
        """The figures in one line (``why`` when there are none)."""
        if self.gpu_total is None or self.gpu_usable is None:
            return self.why or "no memory figures"
        kind = "unified" if self.unified else "own"
        return (f"{self.gpus} x {', '.join(self.names) or 'GPU'}: {gib(self.gpu_usable)} of "
                f"{gib(self.gpu_total)} usable per GPU ({kind} memory; {self.source})")


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def read(host: Host) -> NodeMemory:
    """What ``host``'s GPUs can use now (``HelperFailed`` when the helper cannot answer)."""
    return run_helper(host, HELPER, ARGS, result=NodeMemory, where=f"{host.name}: memory helper",
                      timeout=60)
