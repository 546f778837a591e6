"""Engine flags that `posttrain generate` and `posttrain serve` share: rows decoded together,
the KV cache's dtype and size, speculative decoding (prompt lookup or the model's MTP layer)."""

from __future__ import annotations

from posttrain.errors import UserError

KV_DTYPES = ("auto", "int8", "int8_layered")


def define_engine(flags, fv, *, slots_help: str, speculative_help: str) -> None:
    flags.DEFINE_integer("slots", 0, slots_help, flag_values=fv)
    flags.DEFINE_enum(
        "kv_dtype", "auto", KV_DTYPES,
        "KV cache: auto (the model's compute dtype), int8 (about half the bytes of bfloat16) "
        "or int8_layered (int8, each sequence's last 32 tokens in full precision)",
        flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_integer(
        "num_blocks", 0,
        "KV pool size in blocks of 16 tokens (0: room for every sequence at the model's "
        "full context; set it for long-context models)",
        flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_integer("speculative", -1, speculative_help, flag_values=fv)
    flags.DEFINE_boolean(
        "mtp", False,
        "draft with the checkpoint's multi-token-prediction layer (DeepSeek-V3 and its "
        "kind) instead of prompt lookup; a workdir's comes from its base model (model.hf_path)",
        flag_values=fv,
    )  # fmt: skip


def check_engine(fv, *, default_speculative: int) -> int:
    """Refuses engine flags out of range (before the model loads); returns the draft tokens
    per speculative round (0: plain decoding)."""
    if fv.slots < 0:
        raise UserError(f"--slots must be >= 0 (0: the default), got {fv.slots}")
    if fv.num_blocks < 0:
        raise UserError(f"--num-blocks must be >= 0 (0: sized to fit), got {fv.num_blocks}")
    if fv.speculative < -1:
        raise UserError(f"--speculative must be >= 0 (0: plain decoding), got {fv.speculative}")
    speculative = fv.speculative if fv.speculative >= 0 else 1 if fv.mtp else default_speculative
    if fv.mtp and not speculative:
        raise UserError("--mtp drafts tokens: drop --speculative=0 or set it >= 1")
    if speculative and fv.kv_dtype == "int8_layered":
        raise UserError(
            "--kv-dtype=int8_layered keeps recent tokens in a ring that speculative drafts "
            "would overwrite: use --kv-dtype=int8 or --speculative=0"
        )
    return speculative


def mtp_module(path: str, devices):
    """The MTP module of an HF directory, or of the base model a training workdir started from."""
    import json

    from posttrain import paths
    from posttrain.models import mtp_from_hf

    if (paths.path(path) / "checkpoints").is_dir():
        config = json.loads((paths.path(path) / "config.json").read_text())
        base = config.get("model", {}).get("hf_path")
        if not base:
            raise UserError(
                f"--mtp: the workdir {path} was not started from an HF checkpoint (no "
                f"model.hf_path in its config.json), so it has no multi-token-prediction layer"
            )
        path = base
    return mtp_from_hf(path, mesh=devices)
