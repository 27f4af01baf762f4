"""Ranks started from a warm interpreter: torch and aiodist imported once, each rank forked.

A rank that ``aiodist run`` starts with ``exec`` spends about two seconds of CPU
importing torch before it runs a line of the script: for 4 local ranks on a
small machine, seconds of start-up, and each rank's own copy of torch's Python
heap. As Python's ``multiprocessing`` forkserver does with preloaded modules,
the launcher starts one server process (this file, run as a script),
which imports torch and aiodist once, single-threaded and before any torch
operation (as a ``DataLoader`` forks its workers; native threads such as
OpenBLAS's have their libraries' fork handlers), and then forks a process for
each rank it is asked for; the rank runs its script as ``python script.py`` would
(``__main__``, ``sys.argv``, ``sys.path[0]``, exit status, an uncaught
exception's traceback) in the environment and directory the launcher gives it.

Each rank is the launcher's own child, as with ``exec``: the launcher is a child
subreaper and the server forks twice, so the middle process's exit hands the
rank to the launcher, which waits for it, signals it by pid and reads its exit
status (``Forked``). The server is the launcher's child; a request names the
command, environment and directory in one datagram with the rank's standard
streams beside it (``SCM_RIGHTS``). Anything the server cannot do (it failed to
start, a Python thread appeared while preloading, a command that is not a Python script or
module) falls back to ``exec`` (``--start-method spawn`` always uses it).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ctypes
import importlib.abc
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType, TracebackType

logger = logging.getLogger("aiodist.run")

START_METHODS: Final = (
    "forkserver",
    "spawn",
)  # aiodist run --start-method; the first is the default
# The server runs this file as a script: ``-m aiodist._launch.forkserver`` would import
# the aiodist package before its exit handlers could be deferred (see _DEFERRED). Nothing of
# the launcher's directory is on its path (a rank puts its script's first, as Python does).
_BOOT: Final = (
    "import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv[1], run_name='__main__')"
)
_PR_SET_CHILD_SUBREAPER: Final = 36
_MAX_REQUEST: Final = 1 << 20  # argv and environment of one rank
# What a rank's script imports first: torch (about 2 s of CPU apiece) and aiodist (0.3 s).
_PRELOAD: Final = ("torch", "torch.distributed", "aiodist", "aiodist.sync")
# Preloaded packages whose import registers exit handlers: their order against the
# script's (one registered before ``import aiodist`` runs after aiodist's) stays as a
# fresh interpreter has it, as the script's first import of the package registers them
# (``_Deferred``). torch's stay registered at preloading, before anything of the script.
_DEFERRED: Final = "aiodist"
# A launcher forked from a server (``python -m aiodist run`` asked of it: nested launches,
# the test suite's) gets a server of its own forked beside it, at the same moment, instead
# of starting one (a second import of torch): "fd:pid" of that server, for ``ForkServer``.
_SPARE_ENV: Final = "_AIODIST_FORK_SERVER"


Main = tuple[str, str, list[str], bool]  # ("path" | "module", target, args, unbuffered)


def python_main(cmd: Sequence[str]) -> Main | None:
    """What ``python [-u] script|-m module args`` runs; None for any other command.

    These are the commands a forked rank runs as the interpreter would.
    """
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    rest, unbuffered = list(cmd[1:]), False
    while rest and rest[0] == "-u":
        rest.pop(0)
        unbuffered = True
    if len(rest) >= 2 and rest[0] == "-m":
        return "module", rest[1], rest[2:], unbuffered
    if rest and not rest[0].startswith("-"):
        return "path", rest[0], rest[1:], unbuffered
    return None


def _launches(main: Main) -> bool:
    """Whether ``main`` is ``aiodist run`` (which starts ranks from a server of its own)."""
    kind, target, args, _ = main
    return kind == "module" and target == "aiodist" and args[:1] == ["run"]


class Forked:
    """A rank forked by the server: what ``asyncio.subprocess.Process`` offers the launcher.

    Attributes:
        pid: The rank's process id (a child of this process).
        returncode: Its exit status once it ended (``-N``: killed by signal N), else None.
        stdout: Its standard output, read here.
        stderr: Its standard error, read here.
    """

    def __init__(
        self,
        pid: int,
        stdout: asyncio.StreamReader,
        stdout_pipe: asyncio.BaseTransport,
        stderr: asyncio.StreamReader,
        stderr_pipe: asyncio.BaseTransport,
    ) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = stdout
        self.stderr = stderr
        self.stdin: asyncio.StreamWriter | None = None  # with ForkServer.start(stdin_pipe=True)
        self._pipes = (stdout_pipe, stderr_pipe)
        self._ended = asyncio.Event()
        loop = asyncio.get_running_loop()
        # A thread waits for it, as asyncio's ThreadedChildWatcher does (a pidfd's
        # readiness is not something every loop can watch).
        threading.Thread(
            target=self._reap, args=(loop,), name="aiodist-rank-wait", daemon=True
        ).start()

    def _reap(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            _, status = os.waitpid(self.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # reaped elsewhere: its status is lost
            code = 255
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._end, code)

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    async def wait(self) -> int:
        await self._ended.wait()
        assert self.returncode is not None
        return self.returncode

    def close_pipes(self) -> None:
        """Stop reading its output (a pipe read to its end closes by itself)."""
        for pipe in self._pipes:
            pipe.close()
        if self.stdin is not None:
            self.stdin.close()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not known to be reaped: the pid is still this process's
            # ... or it was reaped a moment ago, by the thread that will set returncode:
            # nothing to signal then (as ``subprocess.Popen.send_signal``).
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's end: starts the server once, then a rank per ``start`` call.

    Not bound to an event loop: each ``start`` runs on the caller's loop, and its
    request and reply go out and back whole under a lock (in a thread).
    """

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._server: subprocess.Popen[bytes] | None = None
        self._spare = _spare_server()  # this process's, if it was forked with one
        self._lock = threading.Lock()
        self._broken = False

    def _open(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        if self._spare is not None:
            self._sock = self._spare[0]
            return self._sock
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._server = subprocess.Popen(
                [sys.executable, "-c", _BOOT, __file__, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C at the terminal is the launcher's to pass on
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self._sock = mine
        return mine

    async def start(
        self,
        cmd: Sequence[str],
        env: dict[str, str],
        cwd: str | None = None,
        stdin_pipe: bool = False,
        stderr: int | None = None,
    ) -> Forked | None:
        """Fork a rank running ``cmd`` in ``env``, its output piped here; None: use exec.

        Its standard input is empty, or with ``stdin_pipe`` a pipe from here (``Forked.stdin``).
        ``stderr``: a file descriptor to write its standard error to instead of a pipe
        (``Forked.stderr`` then reads nothing).
        """
        if python_main(cmd) is None or self._broken:
            return None
        (in_r, in_w) = os.pipe() if stdin_pipe else (os.open(os.devnull, os.O_RDONLY), -1)
        (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        try:
            pid = await asyncio.get_running_loop().run_in_executor(
                None, self.fork, cmd, env, cwd, [in_r, out_w, err_w if stderr is None else stderr]
            )
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        if pid is None:
            for fd in (in_w, out_r, err_r):
                if fd >= 0:
                    os.close(fd)
            return None
        forked = Forked(pid, *await _reader(out_r), *await _reader(err_r))
        if in_w >= 0:
            forked.stdin = await _writer(in_w)
        return forked

    def fork(
        self, cmd: Sequence[str], env: dict[str, str], cwd: str | None, streams: list[int]
    ) -> int | None:
        """Fork ``cmd`` with ``streams`` as its fds 0-2; its pid, or None (use exec).

        Blocking: the reply waits for the fork (and, the first time, for the
        server's preloading). After one failure the server is not asked again.
        """
        main = python_main(cmd)
        if main is None or self._broken:
            return None
        try:
            cwd = cwd or os.getcwd()
            request = {"main": main, "env": env, "cwd": cwd, "spare": _launches(main)}
            data = json.dumps(request).encode()
            if len(data) > _MAX_REQUEST:
                raise ValueError(f"a rank's command and environment take {len(data)} bytes")
            with self._lock:
                sock = self._open()
                socket.send_fds(sock, [data], streams)
                text = sock.recv(4096)
            reply = dict(json.loads(text)) if text else {}
            if "pid" not in reply:
                raise RuntimeError(reply.get("error", "the server went away"))
            return int(reply["pid"])
        except (OSError, ValueError, RuntimeError, AttributeError) as e:
            self._broken = True
            logger.warning("starting ranks from a warm interpreter failed (%s); using exec", e)
            return None

    def close(self) -> None:
        """Stop the server (ranks already started go on)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()  # the server reads end-of-file and exits
                self._sock = None
            if self._spare is not None:
                sock, pid = self._spare
                sock.close()
                _wait_or_kill(pid, 5.0)
                self._spare = None
            if self._server is not None:
                try:
                    self._server.wait(5)
                except subprocess.TimeoutExpired:
                    self._server.kill()
                    self._server.wait()
                self._server = None


def _spare_server() -> tuple[socket.socket, int] | None:
    """The server forked beside this process (``_SPARE_ENV``, taken out of the environment).

    None where there is none, or where the variable does not name a socket of this
    process and a child of it (copied from elsewhere: ignored).
    """
    fd_text, _, pid_text = os.environ.pop(_SPARE_ENV, "").partition(":")
    try:
        fd, pid = int(fd_text), int(pid_text)
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        sock = socket.socket(fileno=fd)
    except (ValueError, OSError, IndexError):
        return None
    if ppid != os.getpid() or sock.type != socket.SOCK_SEQPACKET:
        sock.detach()
        return None
    return sock, pid


def _wait_or_kill(pid: int, timeout: float) -> None:
    """Reap child ``pid``, killing it if it has not ended within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.005)


async def _writer(fd: int) -> asyncio.StreamWriter:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.connect_write_pipe(
        lambda: asyncio.streams.FlowControlMixin(loop=loop), os.fdopen(fd, "wb", 0)
    )
    return asyncio.StreamWriter(transport, protocol, None, loop)


async def _reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**16, loop=loop)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader, loop=loop), os.fdopen(fd, "rb", 0)
    )
    return reader, transport


# The server process.


def _serve(sock: socket.socket, preloaded: list[_Handler] | None = None) -> None:
    """Preload (unless ``preloaded``: a spare server, forked preloaded), then fork ranks."""
    error, handlers = "", list[_Handler]() if preloaded is None else preloaded
    for name in _PRELOAD if preloaded is None else ():
        try:
            if name.partition(".")[0] == _DEFERRED:
                with _exit_handlers_kept(handlers):
                    __import__(name)
            else:
                __import__(name)
        except ImportError as e:
            error = f"preloading {name}: {e}"
            break
    if not error and threading.active_count() != 1:
        error = f"{threading.active_count()} Python threads after preloading; forking is not safe"
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_REQUEST, 3)
        except OSError:
            return
        if not data:
            return  # the launcher closed its end
        try:
            if error:
                raise RuntimeError(error)
            if len(fds) != 3:
                raise RuntimeError(f"a request came with {len(fds)} streams, not 3")
            reply: dict[str, Any] = {"pid": _fork_rank(sock, json.loads(data), fds, handlers)}
        except Exception as e:  # the launcher falls back to exec, saying why
            reply = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps(reply).encode())


def _fork_rank(
    sock: socket.socket, request: dict[str, Any], fds: list[int], handlers: list[_Handler]
) -> int:
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the middle process: forks the rank and ends, handing it to the launcher
        try:
            os.close(r)
            me = os.getpid()  # not the rank's getppid(): this process may be gone by then
            pid = os.fork()
            if pid == 0:
                os.close(w)
                _reparented(me)
                spare = _fork_spare(sock, fds, handlers) if request.get("spare") else None
                _Deferred.install(_DEFERRED, handlers)
                _become_rank(sock, request, fds, spare)  # never returns
            os.write(w, str(pid).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        text = pipe.read()
    os.waitpid(middle, 0)
    if not text:
        raise RuntimeError("the rank's process could not be forked")
    return int(text)


_Handler = tuple[Any, tuple[Any, ...], dict[str, Any]]  # atexit.register's arguments


@contextlib.contextmanager
def _exit_handlers_kept(kept: list[_Handler]) -> Iterator[None]:
    """Keep the exit handlers registered meanwhile in ``kept`` instead of registering them."""
    import atexit

    register = atexit.register

    def keep(fn: Any, *args: Any, **kwargs: Any) -> Any:
        kept.append((fn, args, kwargs))
        return fn

    atexit.register = keep  # type: ignore[assignment]
    try:
        yield
    finally:
        atexit.register = register


class _Deferred(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A preloaded package, out of ``sys.modules`` until the script first imports it.

    That import puts every preloaded module back (nothing runs again) and
    registers the package's exit handlers, when a fresh interpreter would have.
    """

    def __init__(self, modules: dict[str, ModuleType], handlers: list[_Handler]) -> None:
        self._modules, self._handlers = modules, handlers
        self._spec: ModuleSpec | None = None

    @classmethod
    def install(cls, package: str, handlers: list[_Handler]) -> None:
        names = [n for n in sys.modules if n == package or n.startswith(package + ".")]
        if names:
            sys.meta_path.insert(0, cls({n: sys.modules.pop(n) for n in names}, handlers))

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        module = self._modules.get(fullname)
        if module is None or module.__spec__ is None:
            return None
        spec = copy.copy(module.__spec__)
        spec.loader = self
        return spec

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        sys.meta_path.remove(self)
        module = self._modules.pop(spec.name)
        self._spec = module.__spec__  # importlib sets the one found next
        sys.modules.update(self._modules)
        return module

    def exec_module(self, module: ModuleType) -> None:
        import atexit

        module.__spec__ = self._spec
        for fn, args, kwargs in self._handlers:
            atexit.register(fn, *args, **kwargs)


def _fork_spare(sock: socket.socket, fds: list[int], handlers: list[_Handler]) -> str:
    """Fork a server for the rank about to start (a launcher): ``_SPARE_ENV``'s value.

    It is the rank's child, preloaded as this server is, in a session of its own,
    writing to the rank's output as a server the launcher started would.
    """
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            sock.close()
            mine.close()
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            for i, fd in enumerate(fds[1:], 1):
                os.dup2(fd, i)
            for fd in fds:
                os.close(fd)
            _serve(theirs, handlers)
        finally:
            os._exit(0)
    theirs.close()
    return f"{mine.detach()}:{pid}"


def _reparented(middle: int) -> None:
    """Wait (a moment) until the middle process ended and the launcher is our parent."""
    for _ in range(5000):
        if os.getppid() != middle:
            return
        time.sleep(0.001)


def _become_rank(
    sock: socket.socket, request: dict[str, Any], fds: list[int], spare: str | None
) -> None:
    code = 1
    try:
        sock.close()
        os.setsid()  # its own session and process group, as the launcher's exec gives it
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        if spare is not None:
            os.environ[_SPARE_ENV] = spare
        os.chdir(request["cwd"])
        kind, target, args, unbuffered = request["main"]
        _streams(unbuffered or bool(os.environ.get("PYTHONUNBUFFERED")))
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()  # its own entropy, as a process of its own would have
        code = _run_main(kind, target, args)
    except BaseException:
        with contextlib.suppress(BaseException):
            sys.excepthook(*sys.exc_info())
    finally:
        _exit(code)


def _streams(unbuffered: bool) -> None:
    """``sys.stdin``, ``stdout``, ``stderr`` on fds 0-2, buffered as the interpreter's."""

    def writer(fd: int, errors: str, line: bool) -> io.TextIOWrapper:
        raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
        return io.TextIOWrapper(
            raw, errors=errors, line_buffering=line or raw.isatty(), write_through=unbuffered
        )

    sys.stdin = open(0, closefd=False)  # lives as long as the process
    sys.stdout = writer(1, "strict", False)
    sys.stderr = writer(2, "backslashreplace", True)


def _run_main(kind: str, target: str, args: list[str]) -> int:
    """Run the script or module as ``__main__``, as the interpreter does; its exit code."""
    import runpy

    if kind == "path":
        sys.argv = [target, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    else:
        sys.argv = ["-m", *args]
        sys.path.insert(0, os.getcwd())
    try:
        if kind == "path":
            runpy.run_path(target, run_name="__main__")
        else:
            runpy._run_module_as_main(target)  # type: ignore[attr-defined]  # what -m runs
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        _uncaught(e, kind, target)
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # exits as killed by SIGINT, as Python does
        return 130
    except BaseException as e:
        _uncaught(e, kind, target)
        return 1
    return 0


def _uncaught(e: BaseException, kind: str, target: str) -> None:
    """Print it, and keep the interpreter's record of it, which exit handlers read."""
    tb = _from_script(e.__traceback__, kind, target)
    sys.last_type, sys.last_value, sys.last_traceback = type(e), e.with_traceback(tb), tb
    sys.excepthook(type(e), e, tb)


def _from_script(tb: TracebackType | None, kind: str, target: str) -> TracebackType | None:
    """The traceback from the script's own frame on (without runpy's and ours)."""
    start = tb
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if (kind == "path" and os.path.abspath(name) == os.path.abspath(target)) or (
            kind == "module" and tb.tb_frame.f_globals.get("__name__") == "__main__"
        ):
            return tb
        tb = tb.tb_next
    return start


def _finish() -> None:
    """What the interpreter does at exit: join threads, run atexit, flush the streams."""
    import atexit

    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # waits for non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()


def _exit(code: int) -> None:
    with contextlib.suppress(BaseException):
        _finish()
    os._exit(code if 0 <= code <= 255 else 1)


if __name__ == "__main__":
    with socket.socket(fileno=int(sys.argv[-1])) as control:
        _serve(control)
