"""Runs one hidden test of the terminal environment: `/tmp/main.py` in a sandbox whose workspace
is mounted read-only, the test's code on stdin. Trusted: nothing of the workspace runs here.

- Its `sys.path` is the standard library and the system's site-packages, all read-only
  (`python -I`: neither `/tmp`, nor the user's site, nor the workspace): no `sitecustomize`,
  `.pth`, `conftest.py` or module named like a standard one that the model leaves in the
  workspace is ever imported by this process.
- It makes itself undumpable before it reads the test, so the processes the test starts (the
  model's scripts, same uid) can neither read its memory, where the test's code is, nor open its
  file descriptors; it reads the test from stdin and then points stdin at /dev/null.
- `import calc` in the test's own code, `calc` a module of the workspace (not a standard module
  name, nor one installed on the system), gives a proxy: the module runs in a separate Python
  process (`python3` in the workspace, as the model's own `python3` would run it), and only
  plain data crosses back, what `ast.literal_eval` reads from its repr (None, bool, int, float,
  complex, str, bytes, and tuples, lists, dicts and sets of them): a function returning anything
  else (an object whose `__eq__` always says True) raises TypeError here; one that exits,
  crashes or hangs fails the test; changes to list, dict and set arguments come back too; its
  exceptions are raised here as the built-in exception of that name, else RuntimeError.

It exits 0 only when the test ran to its end (or called `sys.exit(0)` itself): the environment
scores that exit status, nothing printed. Status 99 means this runner could not set itself up.
"""

import ast
import builtins
import ctypes
import importlib
import importlib.abc
import importlib.machinery
import os
import site
import subprocess
import sys
import types

WORKSPACE = "/workspace"
MAX_REPLY = 16 << 20  # bytes of one answer from the workspace's process
SETUP_FAILED = 99

# The workspace's process: reads requests (reprs, one a line) on fd argv[1], answers on argv[2].
SERVER = r"""
import ast, importlib, os, sys


class Floats(ast.NodeTransformer):
    def visit_Name(self, node):
        if node.id in ("nan", "inf"):
            return ast.Constant(float(node.id))
        raise ValueError(f"not plain data: {node.id}")

    def visit_Call(self, node):
        return node  # literal_eval takes set() and refuses any other call


def plain(text):
    return ast.literal_eval(Floats().visit(ast.parse(text, mode="eval")))


reader, writer = os.fdopen(int(sys.argv[1]), "rb"), os.fdopen(int(sys.argv[2]), "wb")
del sys.argv[1:]
for line in reader:
    request = plain(line.decode())
    try:
        op, module = request[:2]
        mod = importlib.import_module(module)
        if op == "import":
            reply = ("ok", "module", module)
        elif op == "get":
            obj = getattr(mod, request[2])
            if isinstance(obj, type(sys)):
                reply = ("ok", "module", obj.__name__)
            elif callable(obj):
                reply = ("ok", "function", request[2])
            else:
                reply = ("ok", "value", repr(obj))
        else:
            args, kwargs = list(request[3]), request[4]
            result = getattr(mod, request[2])(*args, **kwargs)
            reply = ("ok", "value", repr(result), repr(args), repr(kwargs))
    except BaseException as e:
        reply = ("error", type(e).__name__, str(e)[:2000])
    writer.write(repr(reply).encode() + b"\n")
    writer.flush()
"""


class _Floats(ast.NodeTransformer):
    """`nan` and `inf`, which repr writes for floats, as the floats."""

    def visit_Name(self, node):
        if node.id in ("nan", "inf"):
            return ast.Constant(float(node.id))
        raise ValueError(f"not plain data: {node.id}")

    def visit_Call(self, node):
        return node  # literal_eval takes set() and refuses any other call


def plain(text: str):
    """The plain data `text` (a repr) stands for; ValueError if it is not plain data."""
    try:
        return ast.literal_eval(_Floats().visit(ast.parse(text, mode="eval")))
    except (SyntaxError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(f"not plain data: {text[:80]!r}") from e


class _Workspace:
    """The Python process the workspace's modules run in, started at the first import."""

    def __init__(self):
        self.proc = None

    def ask(self, *request):
        if self.proc is None:
            self._start()
        try:
            os.write(self.requests, repr(request).encode() + b"\n")
        except BrokenPipeError:
            pass  # the answer below says it is gone
        line = self.answers.readline(MAX_REPLY)
        if not line.endswith(b"\n"):
            status = self.proc.poll()
            raise RuntimeError(
                f"the workspace's Python process ended (status {status}) or answered more than "
                f"{MAX_REPLY} bytes, during {request[0]} {'.'.join(map(str, request[1:3]))}"
            )
        reply = plain(line.decode(errors="replace"))
        if not isinstance(reply, tuple) or reply[:1] not in (("ok",), ("error",)):
            raise RuntimeError(f"the workspace's Python process answered {line[:80]!r}")
        if reply[0] == "error":
            raise _exception(*reply[1:3])
        return reply[1:]

    def _start(self):
        req_r, self.requests = os.pipe()
        ans_r, ans_w = os.pipe()
        self.proc = subprocess.Popen(
            ["python3", "-c", SERVER, str(req_r), str(ans_w)],
            cwd=WORKSPACE,
            stdin=subprocess.DEVNULL,
            pass_fds=(req_r, ans_w),
        )
        os.close(req_r)
        os.close(ans_w)
        self.answers = os.fdopen(ans_r, "rb")


_WS = _Workspace()


def _exception(name, message) -> Exception:
    cls = getattr(builtins, str(name), None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:
            pass
    return RuntimeError(f"{name}: {message}")


def _reflect(originals, updated) -> None:
    """Applies the workspace's changes to list, dict and set arguments to the test's own."""
    for old, new in zip(originals, updated, strict=False):
        if type(old) is list and type(new) is list:
            old[:] = new
        elif type(old) in (dict, set) and type(new) is type(old):
            old.clear()
            old.update(new)


class _RemoteFunction:
    """A function of the workspace: called in its process with plain data, plain data back."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args, **kwargs):
        try:
            plain(repr((args, kwargs)))
        except ValueError as e:
            raise TypeError(
                f"a hidden test passes only plain data to the workspace's {self}: {e}"
            ) from None
        _, value, new_args, new_kwargs = _WS.ask("call", self.module, self.name, args, kwargs)
        try:
            result = plain(value)
        except ValueError:
            raise TypeError(
                f"the workspace's {self} returned {value[:80]}, which is not plain data "
                "(None, bool, numbers, str, bytes, tuples, lists, dicts, sets)"
            ) from None
        _reflect(args, plain(new_args))
        _reflect(kwargs.values(), plain(new_kwargs).values())
        return result

    def __repr__(self):
        return f"<workspace function {self.module}.{self.name}>"


class _RemoteModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        kind, value = _WS.ask("get", self.__name__, name)
        if kind == "function":
            return _RemoteFunction(self.__name__, name)
        if kind == "module":  # only the workspace's own, through _Finder; never a standard one
            if _in_workspace(str(value)):
                module = importlib.import_module(value)
                if isinstance(module, _RemoteModule):
                    return module
            raise TypeError(f"{self.__name__}.{name} is the module {value!r}: not plain data")
        return plain(value)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        _WS.ask("import", spec.name)  # runs the module there; its ImportError is raised here
        return _RemoteModule(spec.name)

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    """Last on `sys.meta_path`: the standard library always wins."""

    def find_spec(self, fullname, path=None, target=None):
        if _in_workspace(fullname):
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


_TEST_IMPORTS: set[str] = set()  # the top-level names the test's own import statements name


def _in_workspace(module: str) -> bool:
    """Whether a module is the workspace's for this test: named by the test's own imports, not
    a standard module's name (even one this Python lacks), a file or directory there."""
    top = module.partition(".")[0]
    return (
        top in _TEST_IMPORTS
        and top not in sys.stdlib_module_names
        and any(os.path.exists(f"{WORKSPACE}/{top}{ext}") for ext in (".py", ""))
    )


def _imports(tree: ast.AST) -> set[str]:
    """Top-level names of the absolute imports in `tree`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.partition(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def main() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 0
        print(f"runner: prctl failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        raise SystemExit(SETUP_FAILED)
    source = sys.stdin.buffer.read().decode(errors="replace")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    site.main()  # the system's site-packages only: -I keeps the user's site (in /tmp) out
    tree = ast.parse(source, "<hidden test>")
    _TEST_IMPORTS.update(_imports(tree))
    sys.meta_path.append(_Finder())
    test = compile(tree, "<hidden test>", "exec")
    # A module of its own as __main__: what looks there (unittest.main) finds the test's names.
    module = types.ModuleType("__main__")
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    exec(test, module.__dict__)


main()
