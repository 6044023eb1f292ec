"""Every door of every task: a usage or profile error is one line naming the flag or key and
exits 2, before any work starts; -h is help everywhere."""

import json
import os
import subprocess
import sys

import pytest

from sparkdeploy.core.files import write_atomic
from sparkdeploy.tasks import _flags as flags
from tests.unit.profiles import ROOT, SEED

URL = "http://127.0.0.1:9"  # never contacted: the flags are refused first


def inv(*args, profile=SEED, cwd=ROOT):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"),
           "INVOKE_SPARKDEPLOY_PROFILE": str(profile)}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=60)


ROWS = [
    (["bench.run", "--max-concurrency", "abc", "--rate", "2", "--url", URL],
     "--max-concurrency: must be an integer, not 'abc'"),
    (["bench.run", "--timeout", "abc"], "--timeout: must be a number, not 'abc'"),
    (["bench.run", "--timeout", "0", "--url", URL], "--timeout: must be > 0, not 0"),
    (["bench.run", "--url", "http://[::1"], "--url: 'http://[::1' is not a URL (Invalid IPv6 URL)"),
    (["bench.run", "--url", "http://host:99999"],
     "--url: 'http://host:99999' is not a URL (Port out of range 0-65535)"),
    (["bench.run", "--requests", "-1", "--url", URL], "--requests: must be >= 1, not -1"),
    (["bench.run", "--warmup", "-1", "--url", URL], "--warmup: must be >= 0, not -1"),
    (["bench.run", "--concurrency", "1,x", "--url", URL], "--concurrency: not a number: 'x'"),
    (["bench.run", "--rate", "0", "--url", URL], "--rate: must be positive: '0'"),
    (["bench.run", "--max-concurrency", "4", "--url", URL],
     "--max-concurrency: only applies with --rate"),
    (["bench.run", "--api", "grpc", "--url", URL], "--api: must be chat or completions, not 'grpc'"),
    (["bench.run", "--json", "/proc/version", "--url", URL],
     "--json: cannot write in /proc: No such file or directory"),
    (["bench.run", "--json", "/nonexistent-dir/x/y.json", "--url", URL],
     "--json: directory /nonexistent-dir/x does not exist (create it first)"),
    (["bench.run", "--plot", "/", "--url", URL], "--plot: / is a directory"),
    (["bench.run", "--baseline-tolerance", "lots", "--url", URL],
     "--baseline-tolerance: not a percentage: 'lots'"),
    (["image.ship", "--to", "nosuchnode"],
     "--to: no worker named 'nosuchnode' (workers: spark2, or all)"),
    (["image.ship", "--to", "spark1"], "--to: no worker named 'spark1' (workers: spark2, or all)"),
    (["model.sync", "--to", "spark1"], "--to: no worker named 'spark1' (workers: spark2, or all)"),
    (["model.sync", "--to", ","], "--to: an empty name in ',' (NAME[,NAME...])"),
    (["hosts.check", "--node", "spark1\n"], "--node: 'spark1\\n' holds a control character"),
    (["deploy.all", "--only", "serve.up,,bench.run"],
     "--only: an empty name in 'serve.up,,bench.run' (NAME[,NAME...])"),
    (["deploy.all", "--only", "serve.up", "--skip", "serve.up"],
     "--only and --skip both name 'serve.up'"),
    (["bench.run", "--timeout", "nan", "--url", URL], "--timeout: must be a finite number, not 'nan'"),
    (["bench.run", "--concurrency", "100000", "--url", URL], "--concurrency: '100000' is out of range (1..4096)"),
    (["bench.run", "--rate", "nan", "--url", URL], "--rate: 'nan' is out of range (0.001..10000)"),
    (["bench.run", "--rate", "1e-300", "--url", URL], "--rate: '1e-300' is out of range (0.001..10000)"),
    (["bench.run", "--rate", "1,inf", "--url", URL], "--rate: 'inf' is out of range (0.001..10000)"),
    (["bench.run", "--requests", "1000000000", "--url", URL], "--requests: must be <= 1000000, not 1000000000"),
    (["bench.run", "--input-tokens", "1000000000", "--url", URL],
     "--input-tokens: must be <= 1000000, not 1000000000"),
    (["bench.run", "--warmup", "1000000000", "--url", URL], "--warmup: must be <= 10000, not 1000000000"),
    (["bench.run", "--baseline-tolerance", "nan%", "--url", URL],
     "--baseline-tolerance: must be a percentage from 0 to 100: 'nan%'"),
    (["bench.compare", "a.json", "b.json", "--max-regression", "5%%"],
     "--max-regression: not a percentage: '5%%'"),
    (["bench.run", "--model", "\x1b[2J", "--url", URL], "--model: '\\x1b[2J' contains a control character ('\\x1b')"),
    (["bench.compare", "a.json", "b.json", "--max-regression", "inf"],
     "--max-regression: must be a percentage from 0 to 100: 'inf'"),
    (["bench.run", "--deadline", "inf", "--url", URL], "--deadline: must be a finite number, not 'inf'"),
    (["image.ship", "--image", "--privileged"],
     "--image: '--privileged' is not an image reference (repo[:tag][@digest], no leading '-')"),
    (["services.stop", "--node", "nosuchnode"],
     "--node: no node named 'nosuchnode' (nodes: spark1, spark2, or all)"),
    (["services.restore", "--node", "spark1,x"], "--node: no node named 'x' (nodes: spark1, spark2, or all)"),
    (["services.status", "--node", "x"], "--node: no node named 'x' (nodes: spark1, spark2, or all)"),
    (["hosts.check", "--node", "x"], "--node: no node named 'x' (nodes: spark1, spark2, or all)"),
    (["hosts.trust", "--node", "x"], "--node: no node named 'x' (nodes: spark1, spark2, or all)"),
    (["lab.up", "--nodes", "two"], "--nodes: must be an integer, not 'two'"),
    (["lab.up", "--nodes", "3", "--dockerd", "containerd,docker26"],
     "--dockerd: must be one of docker26, classic20, containerd, or one per node (3) separated by "
     "commas, not 'containerd,docker26'"),
    (["model.sync", "--to", "x"], "--to: no worker named 'x' (workers: spark2, or all)"),
    (["model.verify", "--node", "x"], "--node: no node named 'x' (nodes: spark1, spark2, or all)"),
    (["serve.logs", "--node", "x"], "--node: no node named 'x' (nodes: spark1, spark2, or all)"),
    (["serve.logs", "--tail", "-3"], "--tail: must be >= 1, not -3"),
    (["serve.up", "--engine", "x"], "--engine: no engine named 'x' (engines: sglang, vllm-ray, vllm)"),
    (["serve.swap"], "--recipe: name the recipe to swap to (recipe.list shows them)"),
    (["serve.add"], "--recipe: name the recipe whose model to place (recipe.list shows them)"),
    (["serve.remove"], "--recipe: name the placed recipe to remove (serve.list shows them)"),
    (["serve.add", "--recipe", "nosuch"], "--recipe: no recipe named 'nosuch' (recipes: "
     "glm-4.5-air-fp8, gpt-oss-120b, gpt-oss-20b, llama-3.3-70b-instruct, "
     "qwen3-235b-a22b-instruct-2507-fp8, qwen3.5-122b-a10b-fp8)"),
    (["serve.add", "--recipe", "gpt-oss-20b", "--nodes", "spark1,x"],
     "--nodes: no node named 'x' (nodes: spark1, spark2)"),
    (["lab.fault", "engine-hang"], "--model: engine-hang needs it (the model's hub repo, as the "
     "profile's model.repo), and only engine-hang takes it"),
    (["lab.fault", "sglang-hang", "--model", "a/b"], "--model: engine-hang needs it (the model's "
     "hub repo, as the profile's model.repo), and only engine-hang takes it"),
    # a recipe asked for is needed even where the profile is not (--url)
    (["bench.run", "--recipe", "nosuch", "--url", URL], "--recipe: no recipe named 'nosuch' (recipes: "
     "glm-4.5-air-fp8, gpt-oss-120b, gpt-oss-20b, llama-3.3-70b-instruct, "
     "qwen3-235b-a22b-instruct-2507-fp8, qwen3.5-122b-a10b-fp8)"),
    (["bench.depth", "--recipe", "nosuch", "--url", URL], "--recipe: no recipe named 'nosuch' (recipes: "
     "glm-4.5-air-fp8, gpt-oss-120b, gpt-oss-20b, llama-3.3-70b-instruct, "
     "qwen3-235b-a22b-instruct-2507-fp8, qwen3.5-122b-a10b-fp8)"),
    (["serve.swap", "--recipe", "gpt-oss-20b", "--engine", "x"],
     "--engine: no engine named 'x' in recipe gpt-oss-20b (engines: vllm)"),
    # --nodes, the one flag that selects nodes; the old spellings stay for one release
    (["services.stop", "--nodes", "spark1,x"], "--nodes: no node named 'x' (nodes: spark1, spark2, or all)"),
    (["hosts.check", "--nodes", "x"], "--nodes: no node named 'x' (nodes: spark1, spark2, or all)"),
    (["model.verify", "--nodes", "x"], "--nodes: no node named 'x' (nodes: spark1, spark2, or all)"),
    (["serve.logs", "--nodes", "x"], "--nodes: no node named 'x' (nodes: spark1, spark2, or all)"),
    (["model.download", "--nodes", "x"], "--nodes: no node named 'x' (nodes: spark1, spark2, or all)"),
    (["model.download", "--nodes", "spark1,spark2"], "--nodes: downloads on one node, not 'spark1,spark2'"),
    (["model.sync", "--nodes", "spark1"], "--nodes: no worker named 'spark1' (workers: spark2, or all)"),
    (["image.ship", "--nodes", "x"], "--nodes: no worker named 'x' (workers: spark2, or all)"),
    (["image.ship", "--nodes", "spark2", "--to", "spark2"], "--nodes: the same as --to: give one of them"),
    (["services.status", "--nodes", "spark1", "--node", "spark1"],
     "--nodes: the same as --node: give one of them"),
    (["hosts.trust", "--nodes", "x", "--profile", str(SEED)],
     "--nodes: no node named 'x' (nodes: spark1, spark2, or all)"),
]


@pytest.mark.parametrize("args,line", ROWS, ids=[" ".join(r[0][:3]) for r in ROWS])
def test_usage_error_is_one_line_and_exit_2(args, line):
    r = inv(*args)
    assert (r.returncode, r.stderr, r.stdout) == (2, line + "\n", "")


def test_nothing_is_left_behind_for_a_refused_output(tmp_path):
    r = inv("bench.run", "--json", str(tmp_path / "a" / "b" / "r.json"), "--url", URL)
    assert r.returncode == 2
    assert list(tmp_path.iterdir()) == []


def test_compare_on_runs_without_summary_is_one_line(tmp_path):
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"runs": [{"concurrency": 1}]}))
    r = inv("bench.compare", str(base), str(base))
    assert (r.returncode, r.stderr) == (
        2, f"{base}: not a benchmark JSON file: runs.0.summary: Field required\n")
    r = inv("bench.compare", str(tmp_path / "nope.json"), str(base))
    assert (r.returncode, r.stderr) == (2, f"BASE: {tmp_path / 'nope.json'}: no such file\n")


def test_non_utf8_profile_is_one_line(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_bytes(SEED.read_bytes().replace(b"name: spark2", b"name: spark\xff"))
    r = inv("services.status", profile=p)
    assert r.returncode == 2
    assert r.stderr.startswith(f"{p}: not UTF-8 text (byte 0xff at offset ") and r.stderr.count("\n") == 1


def test_dash_h_is_help_for_bench_run():
    r = inv("bench.run", "-h")
    assert r.returncode == 0 and r.stdout.startswith("Usage: inv[oke] [--core-opts] bench.run")
    assert "-k, --check-baseline" in r.stdout


def test_no_task_takes_dash_h():
    from sparkdeploy.tasks import ns

    for name in ns.task_names:
        t = ns[name]
        shorts = {n for a in t.get_arguments() for n in a.names if len(n) == 1}
        assert "h" not in shorts, name


def test_output_file_accepts_a_writable_path_and_leaves_no_probe(tmp_path):
    assert flags.output_file("--json", str(tmp_path / "r.json")) == tmp_path / "r.json"
    assert os.listdir(tmp_path) == []


def test_write_atomic_leaves_nothing_when_the_writer_fails(tmp_path):
    target = tmp_path / "r.json"

    def boom(tmp):
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic(target, boom)
    assert os.listdir(tmp_path) == []
    write_atomic(target, lambda tmp: tmp.write_text("{}"))
    assert os.listdir(tmp_path) == ["r.json"] and target.read_text() == "{}"


@pytest.mark.parametrize("text,why", [
    ('{"runs": [{"summary": {"output_tok_s": NaN}}]}', "not a benchmark JSON file"),
    ("[" * 100_000 + "]" * 100_000, "not a benchmark JSON file"),
])
def test_compare_refuses_nan_and_deep_nesting_in_one_line(tmp_path, text, why):
    base = tmp_path / "base.json"
    base.write_text(text)
    r = inv("bench.compare", str(base), str(base))
    assert r.returncode == 2 and r.stderr.startswith(f"{base}: {why}") and r.stderr.count("\n") == 1


@pytest.mark.parametrize("make", [lambda p: os.mkfifo(p), lambda p: p.symlink_to("/dev/zero")],
                         ids=["fifo", "device"])
def test_compare_and_diagnose_refuse_a_fifo_or_a_device_at_once(tmp_path, make):
    p = tmp_path / "in"
    make(p)
    r = inv("bench.compare", str(p), str(p))
    assert (r.returncode, r.stderr.count("\n")) == (2, 1) and "not a regular file" in r.stderr
    r = inv("serve.diagnose", "--log", str(p))
    assert (r.returncode, r.stderr.count("\n")) == (2, 1) and "not a regular file" in r.stderr


# --- the command line's own errors, a reader that goes away (issue 39) ------------------------

def sparkdeploy(*args):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"),
           "INVOKE_SPARKDEPLOY_PROFILE": str(SEED)}
    return subprocess.run([sys.executable, "-c", "from sparkdeploy.cli import main; main()", *args],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("args, line", [
    (["model.estimate", "--weights-gb", "1", "--nodes", "2"],
     "'model.estimate' did not receive required positional arguments: 'config'"),
    (["bench.run", "--runs", "1", "--runs", "2"], "No idea what '2' is!"),
    (["bench.run", "--no-such-flag"], "No idea what '--no-such-flag' is!"),
])
def test_a_parse_error_of_the_installed_command_is_a_usage_exit_2(args, line):
    r = sparkdeploy(*args)
    assert (r.returncode, r.stderr) == (2, line + "\n")
    assert inv(*args).returncode == 1  # invoke's own `inv` exits 1 for these (docs/running.md)


def test_a_reader_that_goes_away_is_no_traceback():
    """``inv profile.check | head -1``: the pipe's reader gone before the profile is printed."""
    r, w = os.pipe()
    os.close(r)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"),
           "INVOKE_SPARKDEPLOY_PROFILE": str(SEED)}
    try:
        p = subprocess.run([sys.executable, "-m", "invoke", "profile.check"], cwd=ROOT, stdout=w,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=60)
    finally:
        os.close(w)
    assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, p.stderr
    assert p.returncode == 1 and p.stderr == ""
