"""Suspend through the compiled storage exchange (``GPUSNAP_STORAGE_SWAP=compiled``): what a
torch without ``UntypedStorage._swap_data_ptr_`` (before 2.13) runs, here forced on a torch
that has it.

Each test runs its programs in fresh processes with their own cache (``XDG_CACHE_HOME``): the
helper is built and loaded once per process, so the build, the cache and the refusals are
seen as a user sees them. Skipped only where no C++ compiler exists.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpusnap import CheckpointError
from gpusnap.moving import suspend

HAS_COMPILER = any(shutil.which(name) for name in (os.environ.get("CXX", "").split() or ["c++", "g++", "clang++"]))
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler to build the storage-swap helper")

# torch's own exchange must not run: the program would pass with it
TRIPWIRE = """
import logging, torch
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
def _native_used(self, other):
    raise AssertionError("torch's _swap_data_ptr_ ran in compiled mode")
torch.UntypedStorage._swap_data_ptr_ = _native_used
"""

ROUND_TRIP = TRIPWIRE + """
from torch import nn
from gpusnap import suspend

def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()

torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 6), nn.Linear(6, 10, bias=False))
model[2].weight = model[0].weight  # tied
model.register_buffer("table", torch.randn(4))
optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
def step(seed):
    optim.zero_grad()
    model(torch.randint(0, 10, (3, 4), generator=torch.Generator().manual_seed(seed))).square().mean().backward()
    optim.step()
step(0)
base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
views = {"base": base, "strided": base[1:, ::3], "transposed": base.T}
outside = base[2]  # a view the state does not list
app_state = {"model": model, "optim": optim, "views": views}
tensors = {**{f"p.{n}": p for n, p in model.named_parameters()},
           **{f"g.{n}": p.grad for n, p in model.named_parameters()},
           **{f"s.{i}.{k}": v for i, st in enumerate(optim.state.values()) for k, v in st.items()},
           "table": model.table, **views}
objects = dict(tensors)
before = {k: bits(t) for k, t in tensors.items()}
addresses = {k: t.data_ptr() for k, t in tensors.items()}

s = suspend(app_state, device="cpu")
assert s.state == "suspended"
assert s.stats.device_freed_bytes == s.stats.bytes > 0, s.stats
# parameters (one tied), gradients, exp_avg/exp_avg_sq/step of each, the buffer, the views' base
assert s.stats.storages == 3 + 3 + 3 * 3 + 1 + 1, s.stats
assert all(tensors[k].data_ptr() != addresses[k] for k in tensors)  # each storage points at its host copy
assert all(torch.equal(bits(t), before[k]) for k, t in tensors.items())  # read from the host copy
try:
    base.untyped_storage().resize_(0)
except RuntimeError as exc:
    assert "not resizable" in str(exc), exc
else:
    raise AssertionError("a suspended storage was resized")

step(1)  # a whole step on suspended state
base.mul_(-1)  # through the base: every view sees it
expected = {k: bits(t) for k, t in tensors.items()}
assert not torch.equal(expected["p.0.weight"], before["p.0.weight"])

s.resume()
assert s.state == "resumed" and s.stats.resumed_bytes == s.stats.bytes
assert all(tensors[k] is objects[k] for k in tensors)
assert all(torch.equal(bits(t), expected[k]) for k, t in tensors.items())
assert model[2].weight is model[0].weight and isinstance(model[0].weight, nn.Parameter)
assert torch.equal(views["strided"], -torch.arange(48.0).reshape(6, 8)[1:, ::3])
assert outside.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
base.add_(1)
assert torch.equal(outside, base[2]) and torch.equal(views["transposed"], base.T)
base.untyped_storage().resize_(base.untyped_storage().nbytes())  # its own memory again: resizable

expected = {k: bits(t) for k, t in tensors.items()}
again = suspend(app_state, device="cpu")  # the kept host memory, through the loaded helper
assert again.stats.host_reused
again.resume(lazy=True)
again.wait()
assert all(torch.equal(bits(t), expected[k]) for k, t in tensors.items())
print("ROUND TRIP OK")
"""

SMALL = TRIPWIRE + """
from gpusnap import suspend
t = torch.arange(1000.0)
s = suspend({"t": t}, device="cpu")
t.add_(1)
s.resume()
assert torch.equal(t, torch.arange(1000.0) + 1)
print("SMALL OK")
"""


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, GPUSNAP_STORAGE_SWAP="compiled", XDG_CACHE_HOME=str(cache))
    env.update(extra)
    return env


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def _helpers(cache: Path) -> list[Path]:
    return sorted((cache / "gpusnap").glob("storage-swap-*.so"))


@needs_compiler
def test_a_cpu_round_trip_through_the_compiled_exchange(tmp_path: Path) -> None:
    done = _run(ROUND_TRIP, _env(tmp_path))
    assert done.returncode == 0 and "ROUND TRIP OK" in done.stdout, done.stderr
    assert "compiled the storage-swap helper" in done.stderr  # logged, once
    assert done.stderr.count("compiled the storage-swap helper") == 1
    (helper,) = _helpers(tmp_path)
    assert torch.__version__ in helper.name
    assert stat.S_IMODE((tmp_path / "gpusnap").stat().st_mode) == 0o700
    assert not helper.stat().st_mode & 0o077
    again = _run(SMALL, _env(tmp_path))  # a second process loads the cached helper
    assert again.returncode == 0 and "SMALL OK" in again.stdout, again.stderr
    assert "compiled the storage-swap helper" not in again.stderr and _helpers(tmp_path) == [helper]


@needs_compiler
def test_two_processes_building_at_once_both_succeed(tmp_path: Path) -> None:
    wait = "import sys\nprint('ready', flush=True)\nsys.stdin.readline()\n"  # (both start the build together)
    procs = [subprocess.Popen([sys.executable, "-c", wait + SMALL], env=_env(tmp_path), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0 and "SMALL OK" in out, err
    (helper,) = _helpers(tmp_path)
    assert not helper.stat().st_mode & 0o077
    assert sorted(p.name for p in (tmp_path / "gpusnap").iterdir()) == [helper.name]  # no build directory left


@needs_compiler
@pytest.mark.parametrize("planted", ["others may write it", "not a library"])
def test_a_cached_helper_that_may_not_be_trusted_is_built_again(tmp_path: Path, planted: str) -> None:
    first = _run(SMALL, _env(tmp_path))
    assert first.returncode == 0, first.stderr
    (helper,) = _helpers(tmp_path)
    if planted == "others may write it":
        helper.chmod(0o666)
    else:
        helper.write_bytes(b"not a shared library")
    inode = helper.stat().st_ino
    again = _run(SMALL, _env(tmp_path))
    assert again.returncode == 0 and "SMALL OK" in again.stdout, again.stderr
    assert "not loading" in again.stderr and "compiled the storage-swap helper" in again.stderr
    assert _helpers(tmp_path) == [helper]
    info = helper.stat()
    assert info.st_ino != inode and not info.st_mode & 0o077  # a new file, ours alone


NO_HELPER = """
import torch
from gpusnap import CheckpointError, suspend
t = torch.arange(8.0)
address = t.data_ptr()
try:
    suspend({"t": t}, device="cpu")
except CheckpointError as exc:
    print("REFUSED", exc)
assert t.data_ptr() == address  # nothing moved
"""


def test_no_compiler_is_a_clear_refusal(tmp_path: Path) -> None:
    done = _run(NO_HELPER, _env(tmp_path, CXX=str(tmp_path / "no-such-compiler")))
    assert done.returncode == 0, done.stderr
    assert "REFUSED cannot suspend: no C++ compiler: CXX=" in done.stdout
    assert _helpers(tmp_path) == []


def test_a_compile_error_is_a_refusal_with_the_compilers_last_lines(tmp_path: Path) -> None:
    compiler = tmp_path / "broken-c++"
    compiler.write_text("#!/bin/sh\necho 'shim.cpp:1: error: the compiler said no' >&2\nexit 1\n")
    compiler.chmod(0o700)
    done = _run(NO_HELPER, _env(tmp_path, CXX=str(compiler)))
    assert done.returncode == 0, done.stderr
    assert "REFUSED cannot suspend: the C++ compiler could not build the storage-swap helper (exit 1)" in done.stdout
    assert "the compiler said no" in done.stdout
    assert _helpers(tmp_path) == [] and [p.name for p in (tmp_path / "gpusnap").iterdir()] == []


def test_an_unknown_mode_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_STORAGE_SWAP", "fast")
    t = torch.arange(4.0)
    with pytest.raises(CheckpointError, match=r"GPUSNAP_STORAGE_SWAP='fast' is not one of auto, native, compiled"):
        suspend({"t": t}, device="cpu")


@pytest.mark.skipif(not hasattr(torch.UntypedStorage, "_swap_data_ptr_"), reason="this torch has no _swap_data_ptr_")
def test_native_mode_uses_torchs_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_STORAGE_SWAP", "native")
    t = torch.arange(4.0)
    s = suspend({"t": t}, device="cpu")
    s.resume()
    assert torch.equal(t, torch.arange(4.0))


@needs_compiler
def test_the_file_loaded_is_the_file_checked(tmp_path: Path) -> None:
    # Another library is renamed over the helper's path between its checks and its load (where a
    # racing rename lands at worst): the checked file is still the one loaded.
    compiler = next(name for name in (os.environ.get("CXX", "").split() or ["c++", "g++", "clang++"])
                    if shutil.which(name))
    planted = tmp_path / "planted.so"
    source = tmp_path / "planted.cpp"
    source.write_text('#include <cstdio>\n__attribute__((constructor)) static void ran() { std::puts("PLANTED RAN"); '
                      'std::fflush(stdout); }\nextern "C" int gpusnap_storage_swap(void*, void*, char*, unsigned long) '
                      '{ return 0; }\n')
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(planted)], check=True, capture_output=True)
    racer = f"""
import ctypes, glob, os
load = ctypes.PyDLL
def renamed_first(name, *args, **kwargs):
    ctypes.PyDLL = load
    (helper,) = glob.glob(os.path.join({str(tmp_path)!r}, "gpusnap", "storage-swap-*.so"))
    os.replace({str(planted)!r}, helper)
    return load(name, *args, **kwargs)
ctypes.PyDLL = renamed_first
"""
    done = _run(TRIPWIRE + racer + SMALL.replace(TRIPWIRE, ""), _env(tmp_path))
    assert done.returncode == 0 and "SMALL OK" in done.stdout, done.stderr
    assert "PLANTED RAN" not in done.stdout and not planted.exists()  # (renamed into place, never loaded)


@pytest.mark.parametrize("ancestor", ["group-writable", "another user's"])
def test_a_cache_below_a_directory_others_may_write_is_refused(tmp_path: Path, ancestor: str) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    if ancestor == "group-writable":
        shared.chmod(0o775)
        found = f"others may write {shared} (mode 0775, no sticky bit)"
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(shared, 65534, 65534)
        found = f"{shared} is owned by uid 65534"
    done = _run(NO_HELPER, _env(shared))
    assert done.returncode == 0, done.stderr
    assert "REFUSED cannot suspend: the cache directory for the storage-swap helper" in done.stdout
    assert found in done.stdout and "set XDG_CACHE_HOME" in done.stdout


ENOUGH_SPACE_FOR_NOTHING = """
import errno, resource, signal, tempfile
if WHAT == "read-only":
    def mkdtemp(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    tempfile.mkdtemp = mkdtemp
else:  # a cache with no room: the source file cannot be written
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
"""


@pytest.mark.parametrize("cache", ["read-only", "full"])
def test_a_cache_that_cannot_be_written_is_a_refusal(tmp_path: Path, cache: str) -> None:
    compiler = tmp_path / "unused-c++"  # (only needs to exist: the cache fails first)
    compiler.write_text("#!/bin/sh\nexit 1\n")
    compiler.chmod(0o700)
    code = "import torch, gpusnap\nWHAT = " + repr(cache) + "\n" + ENOUGH_SPACE_FOR_NOTHING + NO_HELPER
    done = _run(code, _env(tmp_path, CXX=str(compiler)))
    assert done.returncode == 0, done.stderr
    error = "[Errno 30] Read-only file system" if cache == "read-only" else "[Errno 27] File too large"
    assert f"REFUSED cannot suspend: the storage-swap helper cannot be built in the cache: {error}" in done.stdout
    assert _helpers(tmp_path) == [] and [p.name for p in (tmp_path / "gpusnap").iterdir()] == []


def test_a_compiler_that_writes_nothing_is_a_refusal_remembered_for_the_process(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    compiler = tmp_path / "silent-c++"
    compiler.write_text(f"#!/bin/sh\necho called >> {calls}\nexit 0\n")
    compiler.chmod(0o700)
    done = _run(NO_HELPER + NO_HELPER.split("\n", 3)[3], _env(tmp_path, CXX=str(compiler)))  # (suspend twice)
    assert done.returncode == 0, done.stderr
    refusal = f"REFUSED cannot suspend: the C++ compiler ({compiler}) exited 0 but wrote no storage-swap helper"
    assert done.stdout.count(refusal) == 2, done.stdout
    assert calls.read_text() == "called\n"  # the second suspend did not build again
    assert _helpers(tmp_path) == [] and [p.name for p in (tmp_path / "gpusnap").iterdir()] == []


@needs_compiler
def test_a_torch_without_setuptools_builds_the_helper(tmp_path: Path) -> None:
    done = _run("import sys\nsys.modules['setuptools'] = None  # (not installed)\n" + SMALL, _env(tmp_path))
    assert done.returncode == 0 and "SMALL OK" in done.stdout, done.stderr
    assert "compiled the storage-swap helper" in done.stderr


FORK_DURING_BUILD = """
import os, signal, threading
from gpusnap.moving import compiled_swap
parent = threading.Thread(target=compiled_swap.why_not)
parent.start()
with open(os.environ["STARTED"]) as f:  # the compiler runs: the build holds the module's lock
    f.read()
pid = os.fork()
if pid == 0:
    signal.alarm(60)  # (a child hung on the parent's lock dies of it, instead of hanging the test)
    os.environ["CXX"] = os.environ["CHILD_CXX"]
    print("CHILD", compiled_swap.why_not(), flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
with open(os.environ["GO"], "w") as f:
    f.write("go\\n")
parent.join()
print("CHILD STATUS", status)
print("PARENT", compiled_swap.why_not())
"""


def test_a_child_forked_during_a_build_builds_for_itself(tmp_path: Path) -> None:
    started, go = tmp_path / "started", tmp_path / "go"
    os.mkfifo(started)
    os.mkfifo(go)
    compiler = tmp_path / "waiting-c++"  # (says it runs, waits to be let go, then fails)
    compiler.write_text(f"#!/bin/sh\necho started > {started}\nread line < {go}\nexit 1\n")
    compiler.chmod(0o700)
    child_cxx = str(tmp_path / "no-such-compiler")
    done = _run(FORK_DURING_BUILD, _env(tmp_path, CXX=str(compiler), CHILD_CXX=child_cxx, STARTED=str(started),
                                        GO=str(go)))
    assert done.returncode == 0, done.stderr
    assert f"CHILD no C++ compiler: CXX={child_cxx!r} is not a program on PATH" in done.stdout, done.stdout
    assert "CHILD STATUS 0" in done.stdout
    assert "PARENT the C++ compiler could not build the storage-swap helper (exit 1)" in done.stdout
