"""The storage exchange for a torch without ``UntypedStorage._swap_data_ptr_`` (before 2.13):
a small C++ helper, compiled once per torch build and kept in the user's cache.

It does what torch 2.13's ``StorageImpl::swap_data_ptr`` does, with the public ``StorageImpl``
methods older torches have (2.11's headers included): exchange the data pointer, the size,
the allocator and whether the storage is resizable. Call order::

    why_not()                 loads the helper, building it first if the cache lacks it
      _cache_dir()            $XDG_CACHE_HOME/gpusnap (or ~/.cache/gpusnap), private (0700),
                              reached through no directory another user may write
      _load(path)             a file of this user that no one else may write, else rebuilt
      _build(path)            c++ into a private temporary directory, then rename into place
    exchange(a, b)            one exchange; RuntimeError (nothing changed) when refused

Every failure on the way (no compiler, a failed build, an unusable cache) is the reason
``why_not`` answers, kept for the rest of the process. The file is checked and loaded through
one open descriptor, so what is loaded is what was checked.

The helper's one function has a C ABI and catches every C++ exception: it answers a code
and a message. It is loaded with ``ctypes.PyDLL``, which keeps the GIL held during the call,
as torch's own method does. The file's name holds the torch version and a hash of the
source and the compile flags, so a new torch or a changed helper builds a new file; two
processes building at once each build into their own directory and rename, and the last
rename wins with a file as good as the first.

Not exchanged (no public accessor reads them): the flags that make a storage's data pointer
throw or warn. Suspend never exchanges such a storage: copying its bytes to host memory
would have failed first; the helper still refuses a storage whose ``data()`` throws.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from gpusnap import fork_safety

__all__ = ["SOURCE", "exchange", "why_not"]

log = logging.getLogger("gpusnap")

SOURCE = r"""
#include <c10/core/StorageImpl.h>

#include <cstddef>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

namespace {

int refuse(int code, const std::string& why, char* message, std::size_t capacity) noexcept {
  if (message != nullptr && capacity > 0) {
    std::size_t n = why.size() < capacity - 1 ? why.size() : capacity - 1;
    std::memcpy(message, why.data(), n);
    message[n] = '\0';
  }
  return code;
}

}  // namespace

// Exchange the memory of two storages (c10::StorageImpl*): 0, or a code and a message with
// nothing changed (1: not two storages, 2: other devices, 3: other sizes, 4: refused).
extern "C" int gpusnap_storage_swap(void* first, void* second, char* message, std::size_t capacity) noexcept {
  try {
    auto* a = static_cast<c10::StorageImpl*>(first);
    auto* b = static_cast<c10::StorageImpl*>(second);
    if (a == nullptr || b == nullptr) {
      return refuse(1, "not two storages", message, capacity);
    }
    if (a == b) {
      return 0;
    }
    const c10::Device da = a->device(), db = b->device();
    if (da != db) {
      return refuse(2, "storages must be on the same device, got " + da.str() + " and " + db.str(), message, capacity);
    }
    const std::size_t na = a->nbytes(), nb = b->nbytes();  // (throws for a symbolic size)
    if (na != nb && na != 0 && nb != 0) {
      return refuse(3, "storages must have the same nbytes or one must have 0, got " + std::to_string(na) + " and " +
                       std::to_string(nb), message, capacity);
    }
    at::Allocator* const aa = a->allocator();
    at::Allocator* const ab = b->allocator();
    const bool ra = a->resizable(), rb = b->resizable();
    if ((ra && aa == nullptr) || (rb && ab == nullptr)) {  // (set_resizable(true) would assert below)
      return refuse(4, "a resizable storage without an allocator", message, capacity);
    }
    (void)a->data();  // throws for a storage whose data may not be accessed: refused, nothing changed
    (void)b->data();
    // set_data_ptr materializes a lazily copied storage first, which may throw: a's own
    // pointer is put back if b's materialization fails. Nothing after it throws.
    at::DataPtr pa = a->set_data_ptr(at::DataPtr(nullptr, da));
    at::DataPtr pb;
    try {
      pb = b->set_data_ptr(std::move(pa));
    } catch (...) {
      a->set_data_ptr(std::move(pa));  // (untouched: set_data_ptr moves from it only after materializing)
      throw;
    }
    a->set_data_ptr(std::move(pb));
    a->set_nbytes(nb);
    b->set_nbytes(na);
    a->set_allocator(ab);  // allocators before resizable: set_resizable(true) asserts an allocator
    b->set_allocator(aa);
    a->set_resizable(rb);
    b->set_resizable(ra);
    return 0;
  } catch (const c10::Error& e) {
    return refuse(4, e.what_without_backtrace(), message, capacity);
  } catch (const std::exception& e) {
    return refuse(4, e.what(), message, capacity);
  } catch (...) {
    return refuse(4, "an unknown C++ exception", message, capacity);
  }
}
"""

_MESSAGE_BYTES = 512
_BUILD_TIMEOUT_S = 600

_lock = threading.Lock()
_swap: Callable[..., int] | None = None
_failure: str | None = None


def _after_fork_in_child() -> None:
    # A build on another thread of the parent holds _lock and never ends here: the child gets
    # a free lock and, with neither _swap nor _failure set yet, builds or loads for itself.
    global _lock
    _lock = threading.Lock()


fork_safety.at_fork(after_in_child=_after_fork_in_child)


def why_not() -> str | None:
    """Why the helper cannot be used (no compiler, a failed build, an unusable cache), or
    None once it is loaded; builds it the first time a process asks, if the cache lacks it."""
    global _swap, _failure
    with _lock:
        if _swap is None and _failure is None:
            try:
                _swap = _load_or_build()
            except _Unavailable as exc:
                _failure = str(exc)
        return _failure


def exchange(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory of ``a`` and ``b`` as ``a._swap_data_ptr_(b)`` does; RuntimeError
    (nothing changed) when they are on other devices, of other sizes, or the helper refuses."""
    failure = why_not()
    if failure is not None or _swap is None:
        raise RuntimeError(f"cannot exchange storages: {failure}")
    message = ctypes.create_string_buffer(_MESSAGE_BYTES)
    code = _swap(a._cdata, b._cdata, message, _MESSAGE_BYTES)
    if code != 0:
        raise RuntimeError(f"storage exchange: {message.value.decode(errors='replace')}")


class _Unavailable(Exception):
    """The helper cannot be had; the message says why and what to do."""


class _Untrusted(Exception):
    """A file at the helper's path that is not loaded (it is built again over it)."""


def _load_or_build() -> Callable[..., int]:
    flags = _flags("SOURCE.cpp", "OUT.so")  # (the compiler is not in the key: a cached helper needs none)
    key = hashlib.sha256("\0".join([SOURCE, *flags]).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"storage-swap-{torch.__version__}-{key}.so")
    try:
        return _load(path)
    except FileNotFoundError:
        pass
    except _Untrusted as exc:
        log.warning("gpusnap: not loading %s (%s); building it again", path, exc)
    _build(path)
    try:
        return _load(path)
    except (OSError, _Untrusted) as exc:
        raise _Unavailable(f"the storage-swap helper built at {path} could not be loaded: {exc}") from exc


def _cache_dir() -> str:
    from gpusnap.storage.private_dir import ensure_private_dir

    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # (the XDG spec ignores a relative one)
        base = os.path.join(os.path.expanduser("~"), ".cache")
    try:
        folder = ensure_private_dir(os.path.join(base, "gpusnap"), what="gpusnap's cache directory",
                                    elsewhere="set XDG_CACHE_HOME to a directory you own")
    except OSError as exc:
        raise _Unavailable(f"no cache directory for the storage-swap helper: {exc}") from exc
    _check_ancestors(folder)
    return folder


def _check_ancestors(folder: str) -> None:
    """_Unavailable unless every directory above ``folder`` (as given, and with links resolved)
    is owned by this user or root and writable by no one else, or sticky (``/tmp``): another
    user who may rename entries there could put their own cache, and helper, in its place."""
    euid = os.geteuid()
    for start in (folder, os.path.realpath(folder)):
        parent = os.path.dirname(start)
        while True:
            try:
                info = os.stat(parent)
            except OSError as exc:
                raise _Unavailable(f"no cache directory for the storage-swap helper: {exc}") from exc
            found = ""
            if info.st_uid not in (euid, 0):
                found = f"{parent} is owned by uid {info.st_uid}"
            elif info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
                found = f"others may write {parent} (mode {stat.S_IMODE(info.st_mode):04o}, no sticky bit)"
            if found:
                raise _Unavailable(f"the cache directory for the storage-swap helper {folder} must be reached only "
                                   f"through directories of this user (uid {euid}) or root that no one else may "
                                   f"write: {found}; set XDG_CACHE_HOME to a directory below only such directories")
            if parent == os.path.dirname(parent):
                break
            parent = os.path.dirname(parent)


def _load(path: str) -> Callable[..., int]:
    """The helper at ``path``: FileNotFoundError, or _Untrusted for a file that is not a regular
    file of this user, one others may write, or one that does not load. The checks and the load
    see one open file (``/proc/self/fd``), which a rename at ``path`` meanwhile cannot change."""
    try:  # (O_NONBLOCK: a FIFO there does not block the open)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _Untrusted("a symbolic link" if exc.errno == errno.ELOOP else str(exc)) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise _Untrusted(f"mode {stat.S_IMODE(info.st_mode):04o}, uid {info.st_uid}: only a regular file of this "
                             f"user (uid {os.geteuid()}) that no one else may write is loaded")
        try:
            swap = ctypes.PyDLL(f"/proc/self/fd/{fd}").gpusnap_storage_swap
        except (OSError, AttributeError) as exc:
            raise _Untrusted(str(exc)) from exc
    finally:
        os.close(fd)  # (a loaded library keeps its own mapping)
    swap.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    swap.restype = ctypes.c_int
    return swap  # type: ignore[no-any-return]


def _build(path: str) -> None:
    """Compile the helper into a private temporary directory beside ``path``, then rename it to
    ``path`` (atomic: a process loading ``path`` meanwhile sees the old file or the new one)."""
    compiler = _compiler()
    started = time.perf_counter()
    work: str | None = None
    try:
        try:  # (a read-only or full cache)
            work = tempfile.mkdtemp(prefix=".storage-swap-build-", dir=os.path.dirname(path))
            source = os.path.join(work, "storage_swap.cpp")
            with open(source, "w") as f:
                f.write(SOURCE)
        except OSError as exc:
            raise _Unavailable(f"the storage-swap helper cannot be built in the cache: {exc}") from exc
        out = os.path.join(work, "storage_swap.so")
        try:
            done = subprocess.run([*compiler, *_flags(source, out)], capture_output=True, text=True,
                                  timeout=_BUILD_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise _Unavailable(f"the C++ compiler could not build the storage-swap helper: {exc}") from exc
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-12:])
            raise _Unavailable(f"the C++ compiler could not build the storage-swap helper "
                               f"(exit {done.returncode}):\n{tail}")
        if not os.path.isfile(out):
            raise _Unavailable(f"the C++ compiler ({shlex.join(compiler)}) exited 0 but wrote no storage-swap helper")
        try:
            os.chmod(out, 0o700)  # (the linker made it 0777 less the umask)
            os.replace(out, path)
        except OSError as exc:
            raise _Unavailable(f"the storage-swap helper cannot be kept in the cache: {exc}") from exc
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    log.info("gpusnap: compiled the storage-swap helper for torch %s in %.1f s (once per torch build; kept as %s)",
             torch.__version__, time.perf_counter() - started, path)


def _flags(source: str, out: str) -> list[str]:
    # (the paths torch.utils.cpp_extension.include_paths() gives, without importing it: it
    # imports setuptools, which a torch before 2.13 does not require on Python before 3.12)
    root = os.path.dirname(torch.__file__)
    include = os.path.join(root, "include")
    lib = os.path.join(root, "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{include}", f"-I{os.path.join(include, 'torch', 'csrc', 'api', 'include')}",
            source, f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}", "-o", out]


def _compiler() -> list[str]:
    wanted = os.environ.get("CXX", "")
    if wanted:
        words = shlex.split(wanted)
        if not words or shutil.which(words[0]) is None:
            raise _Unavailable(f"no C++ compiler: CXX={wanted!r} is not a program on PATH")
        return words
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name) is not None:
            return [name]
    raise _Unavailable("no C++ compiler (c++, g++ or clang++ on PATH, or CXX) to build the storage-swap helper: "
                       "install one (apt-get install g++), or use torch 2.13 or later")
