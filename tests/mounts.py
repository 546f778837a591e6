"""A small filesystem a test mounts where it needs one full or read-only (root only; the test
is skipped with the reason elsewhere)."""

import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def tmpfs(path, size_kb: int, *options: str):
    """A `size_kb` tmpfs at `path` (made here) with mount `options` (e.g. "ro"), unmounted
    after."""
    os.makedirs(path)
    opts = ",".join([f"size={size_kb}k", *options])
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): run as root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)
