"""`posttrain compile`: TPU slices from a CPU host, memory and FLOPs reports, fit verdicts."""

import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from posttrain import cli
from posttrain.aot import matmul_flops, parse_topology
from posttrain.config import ConfigError, load_config_file, override
from posttrain.methods import compile_plan
from posttrain.models import get_preset
from posttrain.parallel import MeshConfig, make_mesh

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("libtpu")


def test_topology_names_map_to_chips_and_shapes():
    assert parse_topology("v5p-1024") == ("v5p", 512, "v5p:8x8x8")
    assert parse_topology("v5p-8") == ("v5p", 4, "v5p:2x2x1")
    assert parse_topology("v6e-256") == ("v6e", 256, "v6e:16x16")
    assert parse_topology("v5e-8") == ("v5e", 8, "v5e:2x4")
    for bad in ("v5p-1000", "tpu-8", "v7x-8"):
        with pytest.raises(ConfigError, match="topology"):
            parse_topology(bad)


def test_matmul_flops_count_scans_and_recompute():
    def f(x, w):
        def body(h, _):
            return jnp.tanh(h @ w @ w.T), None

        return jax.lax.scan(jax.checkpoint(body), x, None, length=3)[0].sum()

    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
    forward = 3 * 2 * (2 * 8 * 16 * 32)  # 3 steps of two [8,16]x[16,32]-sized matmuls
    assert matmul_flops(jax.make_jaxpr(f)(x, w).jaxpr) == forward
    # Gradients for x and w: the forward, its recomputation in the backward pass (remat), and
    # two matmuls for each forward one.
    grads = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w)
    assert matmul_flops(grads.jaxpr) == 4 * forward


def test_matmul_flops_count_shard_map_bodies_per_manual_device(devices):
    """A fully manual body holds one device's shapes (count it on every device); a body manual
    over `stage` only holds global shapes along the other axes (count it once per stage)."""
    mesh = make_mesh(MeshConfig.from_dict({"stage": 2, "fsdp": 4}))
    x = jnp.ones((8, 8))
    matmul = 2 * 8 * 8 * 8
    for axes, copies in ((set(), 8), ({"stage"}, 2)):
        f = jax.shard_map(lambda x: x @ x, mesh=mesh, in_specs=P(), out_specs=P(),
                          axis_names=axes, check_vma=False)  # fmt: skip
        assert matmul_flops(jax.make_jaxpr(f)(x).jaxpr) == copies * matmul


def test_cli_compiles_the_tiny_sft_step_for_a_v5e_slice(capsys):
    code = cli.main(["compile", "--config=configs/sft.py:tiny", "--topology=v5e-8"])
    out = capsys.readouterr().out
    assert code == 0 and out.strip().splitlines()[-1] == "fits"
    assert "8 x TPU v5e, 16 GiB HBM each" in out and "temporaries" in out
    # The data-parallel gradients meet in all-reduces, timed on the slice's ICI.
    assert re.search(r"all-reduce\s+\d+ runs", out) and "collectives" in out


# Five TPU compiles of the tiny plan at 256 rows (~50-70 s under `make test`'s load): at fewer
# rows its activations are too small for the policies' memory to differ at the table's 0.01
# GiB. fastest_fit's choice is tested below in the default suite.
@pytest.mark.slow
def test_cli_remat_sweep_compiles_the_plan_once_per_policy(capsys):
    sweep = ["--remat-sweep", "--config.data.batch_size=256"]
    code = cli.main(["compile", "--config=configs/sft.py:tiny", "--topology=v5e-8", *sweep])
    out = capsys.readouterr().out
    assert code == 0 and out.strip().splitlines()[-1] == "fits"
    # The sweep: one compile per remat policy. Full remat runs the layers' forward twice: their
    # matmuls' 6 FLOPs per parameter and token become 8 (not the LM head's); keeping every
    # matmul output (none) needs the most memory and recomputes nothing.
    rows = dict(re.findall(r"^(none|full|dots|dots_no_batch|offload_dots)\s+(.*)$", out, re.M))
    assert set(rows) == {"none", "full", "dots", "dots_no_batch", "offload_dots"}
    ratio = {p: float(re.search(r"x([\d.]+)", row).group(1)) for p, row in rows.items()}
    total = {p: float(row.split()[0]) for p, row in rows.items()}
    tiny, length = get_preset("tiny"), 128  # configs/sft.py:tiny's rows
    head = 6 * tiny.embed_dim * tiny.vocab_size
    layers = tiny.flops_per_token(0) - head
    attention = tiny.flops_per_token(length) - tiny.flops_per_token(0)
    full = (layers * 4 / 3 + head + attention) / tiny.flops_per_token(length)
    assert ratio["none"] == pytest.approx(1.0, abs=0.03), out
    assert ratio["full"] == pytest.approx(full, rel=0.05) and full > 1.1, out
    assert total["full"] < total["dots_no_batch"] < total["none"], out
    assert "on host" in rows["offload_dots"]  # listed, not ranked (test below)
    assert re.search(r"fastest that fits: (full|dots_no_batch|dots|none) ", out), out


def test_a_reward_model_plan_counts_no_vocabulary_projection():
    """A reward model's trunk never computes vocabulary logits: the program's matmul FLOPs of
    its step match the model's without the LM head, as an SFT step's match them with it. (XLA
    attention computes every score, twice the causal formula: the +attention below.)"""
    tiny, length = get_preset("tiny"), 48
    attention = tiny.flops_per_token(length) - tiny.flops_per_token(0)
    same = {"model.attention": "xla", "model.checkpoint": "", "data.max_len": length}
    for method in ("sft", "rm"):
        config = load_config_file(os.path.join(REPO, "configs", f"{method}.py") + ":tiny")
        report = compile_plan(override(config, same), "v5e-8")
        model = tiny.flops_per_token(length, lm_head=method == "sft")
        expected = (model + attention) / model  # (x1.09 SFT, x1.11 RM; x0.86 if RM had a head)
        assert report.compiled_flops / report.model_flops == pytest.approx(expected, rel=0.02)


def test_a_ppo_plan_counts_every_epoch_and_its_critic():
    """A PPO step trains the policy and the critic (a trunk with a value head, no vocabulary
    projection) on every token in each of its epochs: the model's FLOPs count all of that, so
    the program's matmul FLOPs match them as an SFT step's match its own (the PPO 8B plan's
    MFU read 22% when only one pass of the policy was counted)."""
    tiny = get_preset("tiny")
    same = {"model.attention": "xla", "model.checkpoint": "", "model.remat": "none"}
    config = override(load_config_file(os.path.join(REPO, "configs", "ppo.py") + ":tiny"), same)
    assert config.algorithm.epochs == 2 and config.critic.init == "policy"
    report = compile_plan(config, "v5e-8", programs=False)
    length = config.rollout.max_prompt_len + config.rollout.max_new_tokens
    rows = config.data.batch_size * config.rollout.num_generations
    attention = tiny.flops_per_token(length) - tiny.flops_per_token(0)
    policy, critic = tiny.flops_per_token(length), tiny.flops_per_token(length, lm_head=False)
    assert report.model_flops == pytest.approx(2 * rows * length * (policy + critic), rel=1e-6)
    # (XLA attention computes every score, twice the causal formula: + attention per model;
    # the program's vocabulary logits come out a few % under the formula's, as in GRPO's plan.
    # Counting one pass of the policy alone, the ratio would be 3.7.)
    expected = (policy + critic + 2 * attention) / (policy + critic)
    assert report.compiled_flops / report.model_flops == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize(
    "freeze",
    [
        pytest.param(["vision/(patch|position|layers)"], id="frozen-encoder"),
        pytest.param([], id="trained-encoder", marks=pytest.mark.slow),
    ],
)
def test_a_vlm_plan_counts_its_images(freeze):
    """A VLM step encodes every image slot and projects its features: the model's FLOPs count
    them (`VisionConfig.flops_per_image`: the encoder's forward, x3 when it trains; the
    projector's first matmul x2 behind a frozen encoder, which needs no input gradient), and
    what one more slot per row adds to the program's matmul FLOPs is exactly that."""
    vlm = get_preset("tiny_vlm")
    same = {"model.preset": "tiny_vlm", "model.attention": "xla", "model.checkpoint": "",
            "model.remat": "none", "model.freeze": freeze, "data.max_len": 64}  # fmt: skip
    config = override(load_config_file(os.path.join(REPO, "configs", "sft.py") + ":tiny"), same)
    rows = config.data.batch_size
    one, two = (
        compile_plan(override(config, {"data.max_images": k}), "v5e-8", programs=False)
        for k in (1, 2)
    )
    per_image = vlm.vision.flops_per_image(vlm.embed_dim, encoder_trained=not freeze)
    assert per_image == (1_015_808 if freeze else 1_867_776)  # (by hand: 16 patches of 8 x 8)
    assert two.model_flops - one.model_flops == rows * per_image
    assert (two.compiled_flops - one.compiled_flops) / rows == pytest.approx(per_image, rel=0.01)


def test_a_plan_compiles_with_the_async_collective_flags_or_says_why_not(monkeypatch):
    """`posttrain compile` compiles each program with libtpu's async collective flag set and
    reports it; where the compiler refuses the program with them (this libtpu fails a
    RET_CHECK on the Kimi K2 plan; here: an option it does not know), it compiles without them
    and the report says so, with the compiler's reason."""
    from posttrain import _collectives

    same = {"model.attention": "xla", "model.checkpoint": ""}
    config = override(load_config_file(os.path.join(REPO, "configs", "sft.py") + ":tiny"), same)
    report = compile_plan(config, "v5e-8")
    assert report.flags == "async collectives" and "libtpu flags  async collectives" in "\n".join(
        report.lines()
    )
    monkeypatch.setattr(_collectives, "TPU_OPTIONS", {**_collectives.TPU_OPTIONS, "xla_nope": "1"})
    refused = compile_plan(config, "v5e-8")
    assert refused.flags.startswith("default (the async collective set failed: "), refused.flags
    assert "xla_nope" in refused.flags and refused.compiled
    assert refused.compiled_flops == report.compiled_flops  # (the same program, other flags)


def test_fastest_remat_is_the_quickest_plan_that_fits():
    from posttrain.aot import CHIPS, CompileReport, GiB, fastest_fit

    def plan(total_gib, flops, host=0.0):  # one v5p chip, compute-bound
        return CompileReport(
            topology="v5p-8", chips=1, chip=CHIPS["v5p"], method="sft", arguments=total_gib * GiB,
            outputs=0.0, temporaries=0.0, aliased=0.0, resident={}, model_flops=1e15,
            compiled_flops=flops, xla_flops=flops, expected_ratio=1.0, bytes_accessed=0.0,
            compile_seconds=1.0, host_temporaries=host * GiB,
        )  # fmt: skip

    reports = {"full": plan(20, 1.33e15), "dots": plan(94, 1.0e15), "none": plan(80, 1.0e15)}
    assert fastest_fit(reports) == "none"  # dots needs 94 of 95 GiB: over the 95% line
    reports["dots_no_batch"] = plan(60, 1.005e15)  # within 1% of the quickest, less memory
    assert fastest_fit(reports) == "dots_no_batch"
    reports = {"full": plan(20, 1.33e15), "offload_dots": plan(30, 1.0e15, host=40)}
    assert fastest_fit(reports) == "full"  # its host transfers are not timed
    assert fastest_fit({"none": plan(200, 1.0e15)}) is None


@pytest.mark.slow  # two TPU compiles, ~40 s
def test_offload_remat_keeps_saved_activations_in_host_memory():
    """remat=offload_dots on a TPU slice: the matmul outputs the backward pass reads wait in
    pinned host memory (the report's host line), which dots_no_batch keeps on the chip."""
    host = {}
    for remat in ("dots_no_batch", "offload_dots"):
        config = override(
            load_config_file(os.path.join(REPO, "configs", "sft.py") + ":tiny"),
            {"model.remat": remat, "data.batch_size": 64, "data.max_len": 256},
        )
        report = compile_plan(config, "v5e-8")
        host[remat] = report.host_temporaries
    assert host["dots_no_batch"] == 0 and host["offload_dots"] > 0, host
    assert any(line.startswith("  host memory") for line in report.lines())


def test_an_rl_plan_compiles_its_samplers_decode_beside_the_step():
    """`posttrain compile` of a GRPO plan compiles the co-located sampler's prefill and decode
    calls as a run makes them on the training mesh: their arguments hold the weights (shared
    with the step) and the engine's KV pool, which the engine replicates over the batch axes
    (computed here from the model's shape); a pool beyond HBM makes the plan not fit, with a
    suggestion that names the engine's settings."""
    from posttrain.aot import suggestion

    values = {"model.checkpoint": "", "model.attention": "xla", "rollout.engine.slots": 8}
    config = override(load_config_file(os.path.join(REPO, "configs", "grpo.py:tiny")), values)
    report = compile_plan(config, "v5e-8")
    prefill, decode = report.programs["rollout prefill"], report.programs["rollout decode"]
    assert report.fits and decode["compiled"] and prefill["compiled"], report.lines()
    tiny = get_preset("tiny")  # float32 keys and values, 16-token blocks, rows of 32 + 8
    blocks = 1 + 8 * -(-(32 + 8) // 16)
    pool = tiny.num_layers * 2 * blocks * 16 * tiny.num_kv_heads * tiny.head_dim * 4
    for program in (prefill, decode):
        assert program["arguments"] >= pool + program["shared"] > pool, report.lines()
    assert "rollout decode: 8 rows of 40 tokens" in "\n".join(report.lines())
    huge = compile_plan(override(config, {"rollout.engine.num_blocks": 1_100_000}), "v5e-8")
    assert huge.total < 1 * 2**30 and not huge.fits  # (the step alone would fit)
    assert not any(p["compiled"] for p in huge.programs.values())  # (the pool alone is too big)
    assert huge.programs["rollout decode"]["arguments"] > huge.capacity
    assert "rollout.engine.slots" in suggestion(huge)


@pytest.mark.parametrize(  # dpo, rm and grpo (~30 s each) in `make test-slow`; ppo has both
    "method",  # a policy and a value head
    [pytest.param("dpo", marks=pytest.mark.slow), pytest.param("rm", marks=pytest.mark.slow),
     pytest.param("grpo", marks=pytest.mark.slow), "ppo"],
)  # fmt: skip
def test_lora_plans_of_every_method_train_only_the_adapters(method):
    """QLoRA (nf4 base) on the tiny model for a v5e-8 slice: the donated state is the adapters
    (and a reward model's heads, PPO's critic), the base a quantised argument, and RL's
    reference is that base (no resident copy) while its sampler holds merged weights."""
    from posttrain.lora import param_bytes, quantized_shapes
    from posttrain.models import get_preset, param_shapes

    file = "ppo.py:tiny" if method == "ppo" else f"{method}.py:tiny"
    config = load_config_file(os.path.join(REPO, "configs", file))
    values = {
        "lora.enabled": True,
        "lora.quantize": "nf4",
        "model.checkpoint": "",
        "model.attention": "xla",  # (the tiny configs' rows are shorter than splash's blocks)
    }
    report = compile_plan(override(config, values), "v5e-8")
    assert report.fits and "LoRA r=8, nf4 base" in report.method, report.lines()
    tiny = get_preset("tiny")
    base = param_bytes(quantized_shapes(tiny, "nf4"))
    assert base < param_bytes(param_shapes(tiny)) / 2
    # The (sharded) base is an argument beside the donated state. (For these tiny shapes XLA's
    # TPU buffers are several times their logical size, e.g. DPO's donated state 0.85 MB for
    # 0.23 MB of adapters and moments, so they are not compared with the adapters here; the
    # slow 8B plans below are.)
    assert report.arguments > report.outputs + base / 8
    if method in ("grpo", "ppo"):
        assert "reference" not in report.resident
        assert "sampler weights (merged)" in report.resident


def test_an_oversized_plan_does_not_fit(capsys):
    code = cli.main(
        [
            "compile",
            "--config=configs/sft.py:tiny",
            "--topology=v5e-8",
            "--config.data.batch_size=16384",
            "--config.data.max_len=8192",
            "--config.model.remat=none",
        ]
    )
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert code == 1 and last.startswith("does not fit: needs") and "remat" in last


@pytest.mark.slow
def test_llama3_8b_sft_fits_v5p_64_with_flops_as_the_model_says():
    config = load_config_file(os.path.join(REPO, "configs", "sft.py") + ":llama3_8b_v5p")
    report = compile_plan(config, "v5p-64")
    assert report.fits and report.total < report.capacity
    ratio = report.compiled_flops / (report.model_flops * report.expected_ratio)
    assert abs(ratio - 1) < 0.10, report.lines()  # no recompute beyond the remat policy
    no_remat = compile_plan(override(config, {"model.remat": "dots", "train.micro_batches": 4}),
                            "v5p-64")  # fmt: skip
    assert abs(no_remat.compiled_flops / no_remat.model_flops - 1) < 0.10, no_remat.lines()


@pytest.mark.slow  # ~50 s; the MoE expert sharding rules: tests/models/test_moe_model.py
def test_a_tiny_mla_moe_plan_compiles_for_tpu_with_expert_parallelism(capsys):
    """MLA (values padded for splash) and the expert-parallel all-to-all, on a TPU target."""
    code = cli.main(
        [
            "compile",
            "--config=configs/sft.py:tiny",
            "--topology=v5e-8",
            "--config.model.preset=tiny_mla_moe",
            "--config.mesh.ici.fsdp=2",
            "--config.mesh.ici.expert=4",
            "--config.model.ep_capacity_factor=2.0",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and out.strip().splitlines()[-1] == "fits", out


def test_a_plan_whose_state_exceeds_hbm_is_reported_without_compiling():
    config = load_config_file(os.path.join(REPO, "configs", "sft.py") + ":kimi_k2_1t")
    report = compile_plan(config, "v5p-256")  # 128 chips: 1T params + Adam do not fit
    assert not report.compiled and not report.fits
    assert report.arguments > report.capacity
    assert "not compiled" in report.lines()[0]


def test_a_batch_the_slice_cannot_split_is_refused_before_compiling():
    config = load_config_file(os.path.join(REPO, "configs", "sft.py") + ":tiny")
    with pytest.raises(ConfigError, match="data-parallel size 8"):
        compile_plan(override(config, {"data.batch_size": 4}), "v5e-8")


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec, topology",
    [
        ("grpo.py:qwen3_8b_v5p", "v5p-64"),
        ("dpo.py:llama3_8b_v5p", "v5p-64"),
        ("sft.py:llama3_70b_v5p", "v5p-256"),
    ],
)
def test_real_size_presets_compile_and_fit_their_slice(spec, topology):
    config = load_config_file(os.path.join(REPO, "configs", spec))
    report = compile_plan(config, topology)
    assert report.fits, report.lines()
    if spec.startswith("grpo"):  # policy + reference, and the sampler's decode with its pool
        assert set(report.resident) == {"reference"}
        assert set(report.programs) == {"rollout prefill", "rollout decode"}


@pytest.mark.slow  # ~2.5 minutes here
def test_gemma3_27b_sft_fits_v5p_32(capsys):
    """Gemma 3 27B (text: 262k vocabulary, five sliding layers per full one, q/k norms, local
    RoPE) on 16 v5p chips: FSDP, full remat, logits in chunks. `posttrain compile` says it fits
    (69.4 GiB of 95 per chip measured), with no recompute beyond the remat policy's."""
    code = cli.main(["compile", "--config=configs/sft.py:gemma3_27b_v5p", "--topology=v5p-32"])
    out = capsys.readouterr().out
    assert code == 0 and out.strip().splitlines()[-1] == "fits", out
    assert "16 x TPU v5p" in out
    found = re.search(r"\(x([\d.]+) of the model's; .* explain x([\d.]+)\)", out)
    assert found and abs(float(found[1]) / float(found[2]) - 1) < 0.10, out


@pytest.mark.slow  # ~2.5 minutes here
def test_gemma3_vlm_grpo_fits_v5p_8(capsys):
    """GRPO with image prompts for Gemma 3 4B image-text (SigLIP encoder frozen, 2 image slots
    per rollout row, 16 prompts x 8 samples) on 4 v5p chips: the step, the reference and the
    sampler's KV cache fit (the step 59.9 of 95 GiB per chip at dots_no_batch, the decode
    48.5, measured). Before the encoder's attention
    went in query chunks under remat, its 4096 x 4096 scores per image and layer needed 867."""
    code = cli.main(["compile", "--config=configs/grpo.py:gemma3_4b_vlm_v5p", "--topology=v5p-8"])
    out = capsys.readouterr().out
    assert code == 0 and out.strip().splitlines()[-1] == "fits", out
    assert "4 x TPU v5p" in out and "rollout decode" in out and "reference" in out


@pytest.mark.slow  # ~4 minutes each here
@pytest.mark.parametrize(
    "spec, topology, length",
    [
        ("sft.py:llama3_8b_128k_v5p", "v5p-64", 131_072),
        ("sft.py:qwen3_8b_1m_v5p", "v5p-256", 1_048_576),
        ("grpo.py:qwen3_8b_32k_v5p", "v5p-64", 32_768),
    ],
)
def test_long_context_plans_fit_their_slice(spec, topology, length):
    """Rows of 128k and 1M tokens (SFT) and 32k-token rollouts (GRPO, with its reference and KV
    cache beside the step), their length split over `sequence` (ring attention) and the logits
    in chunks: the compiled step fits (a row's float32 logits alone would be 63 GB at 128k x
    128k vocabulary, 637 GB at 1M x 152k)."""
    config = load_config_file(os.path.join(REPO, "configs", spec))
    rows = config.data.max_len if spec.startswith("sft") else (
        config.rollout.max_prompt_len + config.rollout.max_new_tokens
    )  # fmt: skip
    assert rows == length
    report = compile_plan(config, topology)
    assert report.compiled and report.fits, report.lines()
    if spec.startswith("sft"):  # (zigzag ring, no tile computed twice; was x2.93 and x3.55)
        assert report.compiled_flops <= 1.25 * report.model_flops, report.lines()


@pytest.mark.slow  # ~3 minutes
def test_a_two_slice_plan_with_pipeline_stages_over_dcn_compiles_and_reports_its_bubble():
    """Only the stages' activations cross the slices; re-materialising at the stage boundary
    (`pipeline_remat=stage`) at least halves the temporaries (33.6 -> 16.6 GiB measured)."""
    config = load_config_file(os.path.join(REPO, "configs", "sft.py") + ":llama3_8b_pp_2x_v5p")
    report = compile_plan(config, "v5p-64", num_slices=2)
    assert report.chips == 64 and report.compiled and report.fits, report.lines()
    assert report.bubble == 1 / 9  # 2 stages, 8 microbatches
    assert any(line.startswith("  pipeline bubble 11%") for line in report.lines())
    over_dcn = {k for k, row in report.communication.items() if row.get("dcn_seconds")}
    # FSDP's gathers and their ring hops stay in a slice (the all-reduce of the gradients of
    # the params every stage holds, embeddings and head, crosses it)
    assert not over_dcn & {"all-gather", "collective-permute", "reduce-scatter"}, report.lines()
    stage = compile_plan(
        override(config, {"model.pipeline_remat": "stage"}), "v5p-64", num_slices=2
    )
    assert stage.compiled and stage.temporaries <= 0.5 * report.temporaries, stage.lines()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sft", "grpo"])
def test_kimi_k2_fits_v5p_1024(method):
    """The 1T-parameter MoE: SFT, and GRPO with its reference and rollout KV cache beside it."""
    config = load_config_file(os.path.join(REPO, "configs", f"{method}.py") + ":kimi_k2_1t")
    report = compile_plan(config, "v5p-1024")
    assert report.chips == 512 and report.compiled and report.fits, report.lines()
    assert report.total < 95 * 2**30
    # Program FLOPs: the model's (active parameters) x remat x the expert buffers' padding.
    ratio = report.compiled_flops / (report.model_flops * report.expected_ratio)
    assert abs(ratio - 1) < 0.10, report.lines()
    if method == "grpo":  # the reference beside it, and the sampler's decode over the slice
        assert set(report.resident) == {"reference"}
        assert all(p["compiled"] for p in report.programs.values())


@pytest.mark.slow
def test_lora_sft_state_is_the_adapters_not_the_model():
    """Llama 3.1 8B on v5p-64 with LoRA r=8: the donated state (adapters + AdamW moments) is
    ~0.15 GiB per chip against 2.8 GiB for the full fine-tune; the frozen base is an argument."""
    config = load_config_file(os.path.join(REPO, "configs", "sft.py") + ":llama3_8b_v5p")
    full = compile_plan(config, "v5p-64")
    lora = compile_plan(override(config, {"lora.enabled": True}), "v5p-64")
    assert lora.fits and "LoRA" in lora.method
    assert lora.outputs < 0.1 * full.outputs, (lora.lines(), full.lines())
    base = 8.03e9 * 4 / 32  # float32 params per chip
    assert lora.arguments - lora.outputs > 0.9 * base  # the base is still resident
    assert lora.arguments < 0.5 * full.arguments
    # QLoRA: the nf4 base takes 0.39 GiB per chip of arguments against 1.09 GiB (measured).
    qlora = compile_plan(override(config, {"lora.enabled": True, "lora.quantize": "nf4"}), "v5p-64")
    assert qlora.fits and "nf4 base" in qlora.method
    assert qlora.arguments < 0.5 * lora.arguments, (qlora.lines(), lora.lines())
    assert qlora.outputs == lora.outputs  # the same adapters' state


def test_engine_decode_compiles_with_the_ragged_paged_attention_kernel_for_tpu():
    """The engine's decode chunk with `attention="ragged"` (a combined pool, the TPU kernel)
    compiles for a v5e chip from this CPU host, and the kernel is in the program."""
    import numpy as np

    from posttrain.aot import topology_devices
    from posttrain.models import Transformer, get_preset, param_shapes
    from posttrain.sampling import EngineConfig
    from posttrain.sampling._paged import decode, empty_rows

    _, devices = topology_devices("v5e-8")
    mesh = jax.sharding.Mesh(np.array(devices[:1]), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    config = get_preset("tiny", attention="xla", compute_dtype="bfloat16", head_dim=128)
    engine = EngineConfig(slots=8, block_size=16, attention="ragged")
    assert engine.kernel(config, "tpu") == "ragged"
    # On a mesh of several chips XLA cannot partition the Mosaic call: auto takes the XLA
    # gather there (as `posttrain compile` of a sharded plan's decode does), ragged is refused.
    auto = EngineConfig(slots=8, block_size=16)
    assert auto.kernel(config, "tpu", 1) == "ragged" and auto.kernel(config, "tpu", 8) == ""
    with pytest.raises(ValueError, match="runs on one device"):
        engine.kernel(config, "tpu", 8)

    def on_tpu(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)

    model = Transformer(jax.tree.map(on_tpu, param_shapes(config)), config)
    rows = jax.tree.map(
        on_tpu, jax.eval_shape(lambda: empty_rows(config, engine, 65, 8, combined=True))
    )
    eos = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=replicated)
    with jax.set_mesh(mesh):
        compiled = (
            decode.trace(model, rows, eos, steps=2, blocks=8, block_size=16, kernel="ragged")
            .lower(lowering_platforms=("tpu",))
            .compile()
        )
    assert "ragged_paged_attention" in compiled.as_text()


def test_a_configured_compilation_cache_is_left_out_of_slice_compiles(tmp_path, recwarn):
    """libtpu's compile-only client cannot read back what it writes to JAX's persistent cache:
    a plan compiled with a cache configured writes nothing there and warns nothing, and the
    cache is on again afterwards."""
    config = load_config_file(os.path.join(REPO, "configs", "sft.py") + ":tiny")
    cache = str(tmp_path / "cache")
    saved = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", cache)
    try:
        compile_plan(override(config, {"model.attention": "xla"}), "v5e-8")
        assert jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_compilation_cache_dir", saved)
    assert not os.path.exists(cache) or not os.listdir(cache)
    assert not [w for w in recwarn if "compilation cache" in str(w.message)]
