"""What every command shares: absl flags parsed from an explicit argv (so `main([...])` from
Python behaves as the shell), `--config=file.py[:preset]` with `--config.a.b=value` overrides,
`--help` with examples, and joining a multi-process run."""

from __future__ import annotations

import difflib

from absl import flags

from posttrain.errors import UserError


def _normalize(argv: list[str]) -> list[str]:
    """Accepts --max-new-tokens as well as absl's --max_new_tokens."""
    return [argv[0]] + [
        a.split("=", 1)[0].replace("-", "_").replace("__", "--", 1)
        + ("=" + a.split("=", 1)[1] if "=" in a else "")
        if a.startswith("--")
        else a
        for a in argv[1:]
    ]


class _ListParser(flags.ArgumentParser):
    """`--config.a.b=[...]` for a list field: a JSON or Python literal (docs/configs.md)."""

    def parse(self, argument):
        import ast
        import json

        if isinstance(argument, list):
            return argument
        try:
            value = json.loads(argument)
        except ValueError:
            try:
                value = ast.literal_eval(argument)
            except (SyntaxError, ValueError):
                value = None
        if not isinstance(value, list):
            raise ValueError(
                f"{argument!r} is not a list: write a JSON or Python list, e.g. [] or "
                '\'[{"path": "a.jsonl", "weight": 1.0}]\''
            )
        return value

    def flag_type(self) -> str:
        return "list"


def config_flag(fv, argv: list[str]) -> None:
    """`--config=configs/<method>.py[:preset]` with `--config.a.b=value` overrides, read from
    `argv` (not sys.argv, so `main([...])` from Python overrides the same way); a list field
    takes a JSON or Python list literal."""
    import os

    from ml_collections import config_flags

    config_flags.register_flag_parser_for_type(list, _ListParser())

    for spec in (a.split("=", 1)[1] for a in _normalize(argv) if a.startswith("--config=")):
        if not os.path.isfile(spec.partition(":")[0]):
            raise UserError(f"--config={spec}: no such config file (configs/<method>.py[:preset])")
    config_flags.DEFINE_config_file(
        "config",
        None,
        "configs/<method>.py[:preset]",
        flag_values=fv,
        lock_config=True,
        sys_argv=_normalize(argv),
    )


def _help(argv: list[str], values, text: str, examples: list[str]) -> str:
    lines = [f"usage: {argv[0]} [flags]", "", text, "", "examples:"]
    lines += [f"  {e}" for e in examples] + ["", "flags:"]
    for module, defined in values.flags_by_module_dict().items():
        if module.startswith("absl"):
            continue  # --flagfile, --undefok
        for flag in defined:
            default = "" if flag.default in (None, "") else f" (default: {flag.default})"
            lines.append(f"  --{flag.name}: {flag.help}{default}")
    return "\n".join(lines)


def _config_key_error(argv: list[str]) -> str:
    """Which --config.a.b override names no key of the config file, and the nearest key."""
    from posttrain.config import load_config_file, retired_key
    from posttrain.methods import METHODS

    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    overrides = [a[len("--config.") :].split("=", 1)[0] for a in argv if a.startswith("--config.")]
    try:
        config = load_config_file(spec)
        keys = _dotted_keys(config)
    except Exception:  # the file itself is broken: its own error is clearer
        return f"{overrides} names a key the config does not have"
    method = METHODS.get(config.get("method", "sft"))
    for key in (k for k in overrides if k not in keys):
        instead = method and retired_key(method.config, key)
        if instead:
            return f"--config.{key}: {spec} has no key {key!r} any more: {instead}"
        near = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.6)
        hint = f"; did you mean --config.{near[0]}?" if near else ""
        return f"--config.{key}: {spec} has no key {key!r}{hint}"
    return f"{overrides} names a key the config does not have"


def _dotted_keys(config, prefix: str = "") -> set[str]:
    keys = set()
    for name, value in config.items():
        keys.add(prefix + name)
        if hasattr(value, "items"):
            keys |= _dotted_keys(value, f"{prefix}{name}.")
    return keys


def _without_traceback(message: str) -> str:
    """ml_collections puts the traceback of a config file's error in its flag error; keep its
    first line (which flag) and last (the error)."""
    if "Traceback (most recent call last)" not in message:
        return message
    lines = [line for line in message.splitlines() if line.strip()]
    return f"{lines[0]} {lines[-1]}"


def parse(argv: list[str], define, help: tuple[str, list[str]] = ("", [])) -> flags.FlagValues:
    """Defines the command's absl flags with `define(flags, flag_values)` and parses `argv`
    into them; `--help` prints `help` (what the command does, examples) and the flags, and
    exits."""
    values = flags.FlagValues()
    define(flags, values)
    argv = _normalize(argv)
    if any(a in ("--help", "-h", "--helpfull") for a in argv[1:]):
        print(_help(argv, values, *help))
        raise SystemExit(0)
    try:
        values(argv)
    except flags.Error as e:
        raise UserError(_without_traceback(str(e))) from None
    except (KeyError, AttributeError):  # a --config.a.b override naming no config key
        raise UserError(_config_key_error(argv)) from None
    return values


def define_distributed(fv) -> None:
    """The flags that join a multi-process run (`join`)."""
    flags.DEFINE_string(
        "coordinator", "", "multi-process: host:port of process 0 (TPU VMs, Slurm and Open MPI "
        "are detected without it); env POSTTRAIN_COORDINATOR", flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_integer(
        "num_processes", 0, "multi-process: number of processes; env POSTTRAIN_NUM_PROCESSES",
        flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_integer(
        "process_id", -1, "multi-process: this process's id; env POSTTRAIN_PROCESS_ID",
        flag_values=fv,
    )  # fmt: skip


def join(fv) -> bool:
    """Joins the multi-process run (no-op alone); True when there are several processes."""
    from posttrain.parallel import DistributedConfig, initialize

    several = initialize(  # a DistributedError is a user error: the CLI prints its message
        DistributedConfig.from_env(
            coordinator=fv.coordinator, num_processes=fv.num_processes, process_id=fv.process_id
        )
    )
    if several:
        import logging

        import jax

        if jax.process_index() > 0:  # one log for the run: process 0's (warnings from all)
            logging.getLogger("posttrain").setLevel(logging.WARNING)
    return several


def define_mesh(fv) -> None:
    """`--mesh=fsdp=4,tensor=2`: the device mesh a command loads its model onto."""
    flags.DEFINE_string(
        "mesh", "", "shard the model over a device mesh, e.g. fsdp=4,tensor=2 (axes: data, "
        "fsdp, expert, sequence, tensor; -1 takes the remaining devices); default one device",
        flag_values=fv,
    )  # fmt: skip


def mesh(value: str):
    """The `jax.sharding.Mesh` of a `--mesh` value, or None for an empty one."""
    if not value:
        return None
    from posttrain.parallel import MeshConfig, make_mesh

    try:
        sizes = {}
        for part in value.split(","):
            axis, _, size = part.partition("=")
            sizes[axis.strip()] = int(size)
        return make_mesh(MeshConfig.from_dict(sizes))
    except ValueError as e:
        raise UserError(
            f"--mesh={value!r}: {e} (write axis=size pairs, e.g. fsdp=4,tensor=2)"
        ) from None


def check_workers(workers: int) -> None:
    """A --workers flag whose 0 means one process per CPU core."""
    if workers < 0:
        raise UserError(f"--workers={workers}: give 0 (one per CPU core) or a number of processes")


def check_folder(flag: str, path: str) -> None:
    """A folder flag (a workdir) that names an existing file is refused before anything runs."""
    import os

    from posttrain import paths

    if not paths.is_remote(path) and os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"--{flag}={path} is a file; give a folder (a new one, or a run's)")
