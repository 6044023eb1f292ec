"""Properties of The save_filter.py helper over random images and random peers, both layouts.

For any layer list (repeats allowed) and any set of diff IDs the peer is said to have, the
filtered archive loads on a peer holding the have-prefix chain into exactly the image: every
layer above the prefix is in the archive, none of the prefix's is (unless it recurs above it),
and nothing else changes."""

import io
import json
import tarfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit import test_save_filter as tsf

sf = tsf.sf
POOL = [tsf.layer_tar(f"p{i}", bytes([65 + i]) * (700 + 300 * i)) for i in range(6)]
POOL_DIFF = [tsf.sha(t) for t in POOL]
OUTSIDE = ["sha256:" + "9" * 64]  # a diff ID no layer of the image has


def archive(layout: str, idx: list[int]) -> tuple[bytes, list[str]]:
    tars = [POOL[i] for i in idx]
    diff_ids = [POOL_DIFF[i] for i in idx]
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    if layout == "legacy":
        (_, raw), _ = tsf.legacy_archive(tars, diff_ids, config)
    else:
        blobs = dict(zip(diff_ids, tars, strict=True))
        _, raw = tsf.oci_archive(blobs, config, ["blobs/sha256/" + d[7:] for d in diff_ids])
    return raw, diff_ids


def run(raw: bytes, layers: list[str], have: list[str]) -> tuple[bytes, dict]:
    plan = sf.Drops(have, layers, [])
    out, err = io.BytesIO(), io.StringIO()
    f = sf.Filter(plan, io.BytesIO(raw), out, err=err)
    f.run()
    return out.getvalue(), f.check()


def load(raw: bytes, peer_chain: list[str]) -> list[str]:
    """docker load on the classic store: a layer left out must be on the peer's chain."""
    with tarfile.open(fileobj=io.BytesIO(raw)) as t:
        members = {m.name.rstrip("/"): m for m in t.getmembers()}
        manifest = json.loads(t.extractfile("manifest.json").read())[0]
        diff_ids = json.loads(t.extractfile(manifest["Config"]).read())["rootfs"]["diff_ids"]
        sent = []
        for i, (path, diff) in enumerate(zip(manifest["Layers"], diff_ids, strict=True)):
            if path in members:
                m = members[path]
                if m.issym():  # legacy: a repeated layer links to its first copy ("../<v1>/...")
                    assert m.linkname.startswith("../")
                    m = members[m.linkname[3:]]
                assert tsf.sha(t.extractfile(m).read()) == diff
                sent.append(i)
            else:
                assert diff_ids[: i + 1] == peer_chain[: i + 1], f"layer {i} left out, peer lacks it"
    return sent


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(["oci", "legacy"]),
       idx=st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=6),
       present=st.sets(st.integers(0, len(POOL) - 1)),
       outside=st.booleans())
def test_output_loads_into_exactly_the_missing_layers(layout, idx, present, outside):
    raw, layers = archive(layout, idx)
    have = [POOL_DIFF[i] for i in sorted(present)] + (OUTSIDE if outside else [])
    k = 0
    while k < len(layers) and layers[k] in have:
        k += 1
    droppable = set(layers[:k]) - set(layers[k:])
    out, report = run(raw, layers, have)
    assert report["errors"] == [] and not report["unsafe"]
    assert report["prefix_layers"] == k
    sent = load(out, layers[:k])  # the peer holds the have-prefix as a chain
    # exactly the layers the peer lacks arrive, and a layer of the prefix that recurs above it
    assert sent == [i for i, d in enumerate(layers) if d not in droppable]
    assert {d["diff_id"] for d in report["dropped"]} == droppable
    assert report["missed"] == []
    # everything else is byte for byte the input: dropping nothing changes nothing
    if not droppable:
        assert out == raw


@settings(max_examples=25, deadline=None)
@given(layout=st.sampled_from(["oci", "legacy"]),
       idx=st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=5, unique=True))
def test_a_have_set_off_the_prefix_drops_nothing(layout, idx):
    """Every layer but the first present: nothing is a chain prefix, nothing may be dropped."""
    raw, layers = archive(layout, idx)
    out, report = run(raw, layers, layers[1:])
    assert out == raw and report["dropped"] == [] and report["prefix_layers"] == 0
