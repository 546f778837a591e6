"""`posttrain serve`: the OpenAI HTTP API over an HF model directory or a training workdir."""

from __future__ import annotations

import contextlib
import os
import sys

from posttrain.cli._engine_flags import check_engine, define_engine, mtp_module
from posttrain.cli._flags import define_mesh, mesh, parse
from posttrain.errors import UserError

HELP = (
    "Serve a model over the OpenAI HTTP API (/v1/completions, /v1/chat/completions with tools "
    "and streaming, /v1/models, /health) until Ctrl-C. See docs/generation.md.",
    [
        "posttrain serve --model=runs/sft_tiny --port=8000",
        "posttrain serve --model=HF_DIR --host=0.0.0.0 --preset=latency --served-model-name=mine",
        "posttrain serve --model=gs://bucket/run --mesh=fsdp=4,tensor=2",
    ],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_string("model", None, "HF model directory or training workdir", flag_values=fv)
        flags.DEFINE_string("host", "127.0.0.1", "address to listen on", flag_values=fv)
        flags.DEFINE_integer("port", 8000, "port to listen on (0: any free one)", flag_values=fv)
        flags.DEFINE_string(
            "preset", "throughput",
            "throughput (64 sequences decode together, 16 steps per device call) or latency "
            "(8 sequences, 4 steps, speculative decoding with prompt lookup: first tokens "
            "sooner)",
            flag_values=fv,
        )  # fmt: skip
        define_engine(
            flags, fv, slots_help="sequences decoded together (0: the preset's, 64 or 8)",
            speculative_help="draft tokens per speculative round, 0 for plain decoding "
            "(default: the preset's: 0 for throughput, 4 for latency; 1 with --mtp)",
        )  # fmt: skip
        flags.DEFINE_string(
            "served_model_name", None, "the model id clients name (default: --model)",
            flag_values=fv,
        )  # fmt: skip
        flags.DEFINE_integer(
            "max_request_samples", 64, "most sequences (n x prompts) one request may ask for; "
            "more is HTTP 400", flag_values=fv,
        )  # fmt: skip
        flags.DEFINE_integer(
            "max_sequences", 0, "sequences in flight or waiting, all requests together; more "
            "get HTTP 429 (0: four times the preset's rows)", flag_values=fv,
        )  # fmt: skip
        flags.DEFINE_integer(
            "max_queue_tokens", 0, "KV tokens (prompts + n x max_tokens) in flight or waiting; "
            "more get HTTP 429 (0: four times the KV pool)", flag_values=fv,
        )  # fmt: skip
        flags.DEFINE_integer(
            "max_body_mb", 8, "largest request body in MiB; larger ones are answered 413 unread",
            flag_values=fv,
        )  # fmt: skip
        flags.DEFINE_string(
            "api_key", None, "the key /v1/* requests must send as 'Authorization: Bearer KEY' "
            "(default: $POSTTRAIN_API_KEY; the environment keeps it out of `ps`)", flag_values=fv,
        )  # fmt: skip
        flags.DEFINE_integer(
            "drain_s", 5, "on SIGTERM or Ctrl-C, seconds the answers in flight get before the "
            "server exits", flag_values=fv,
        )  # fmt: skip
        define_mesh(fv)

    fv = parse(argv, define, HELP)
    if not fv.model:
        raise UserError("--model=HF_DIR_OR_WORKDIR is required")
    for name in ("max_request_samples", "max_body_mb"):
        if fv[name].value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {fv[name].value}")
    for name in ("max_sequences", "max_queue_tokens", "drain_s"):
        if fv[name].value < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {fv[name].value}")
    from posttrain.sampling import SERVE_PRESETS

    if fv.preset not in SERVE_PRESETS:
        raise UserError(
            f"unknown serve preset {fv.preset!r}; choose one of {sorted(SERVE_PRESETS)}"
        )
    preset = SERVE_PRESETS[fv.preset]
    speculative = check_engine(fv, default_speculative=preset.speculative)
    _check_address(fv.host, fv.port)
    api_key = fv.api_key if fv.api_key is not None else os.environ.get("POSTTRAIN_API_KEY", "")
    if not api_key and not _loopback(fv.host):
        print(
            f"posttrain: warning: --host={fv.host} serves beyond this machine and no API key is "
            "set: anyone who can reach the port can use the model (set POSTTRAIN_API_KEY)",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    import jax

    from posttrain.lora import load_model_and_tokenizer
    from posttrain.sampling import ServeConfig, serve

    config = ServeConfig.from_preset(  # before the model loads
        fv.preset,
        model_name=fv.served_model_name or fv.model,
        max_request_samples=fv.max_request_samples,
        max_sequences=fv.max_sequences,
        max_queue_tokens=fv.max_queue_tokens,
        max_body_bytes=fv.max_body_mb * 2**20,
        api_key=api_key,
        drain_s=fv.drain_s,
        engine=dict(
            num_blocks=fv.num_blocks,
            kv_dtype=fv.kv_dtype,
            speculative=speculative,
            **({"slots": fv.slots} if fv.slots else {}),
        ),
    )
    devices = mesh(fv.mesh)
    with jax.set_mesh(devices) if devices is not None else contextlib.nullcontext():
        model, tokenizer = load_model_and_tokenizer(fv.model, mesh=devices)
        module = mtp_module(fv.model, devices) if fv.mtp else None
    serve(model, tokenizer, config, host=fv.host, port=fv.port, mesh=devices, mtp=module)
    return 0


def _check_address(host: str, port: int) -> None:
    """Refuses, before the model loads, an address the server could not listen on."""
    import socket

    if not 0 <= port <= 65535:
        raise UserError(f"--port={port}: a port is 0 to 65535 (0: any free one)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as e:  # (socket.gaierror included: a host that does not resolve)
        reason = e.strerror or str(e)
        raise UserError(f"--host={host} --port={port}: cannot listen there ({reason})") from None


def _loopback(host: str) -> bool:
    """Whether every address `host` resolves to is this machine's loopback."""
    import ipaddress
    import socket

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
