"""Supervised fine-tuning.

    posttrain train --config=configs/sft.py:tiny --workdir=/tmp/sft_tiny    # CPU, ~3 minutes

Presets:
  tiny           a 0.17M-parameter model trained from scratch on the bundled arithmetic task (CPU).
  llama3_8b_v5p  Llama 3.1 8B full fine-tune on a v5p-64 slice (set model.hf_path, data).
  llama3_70b_v5p Llama 3.3 70B full fine-tune on a v5p-256 slice (set model.hf_path, data).
  qwen3_32b_v5p  Qwen3 32B full fine-tune on a v5p-256 slice (set model.hf_path, data).
  gemma3_27b_v5p Gemma 3 27B (text) full fine-tune on a v5p-32 slice (16 chips; set
                 model.hf_path, data).
  llama3_8b_128k_v5p    Llama 3.1 8B at 128k tokens per row on v5p-64: each row's length
                        split over sequence=8 (ring attention), logits in chunks.
  qwen3_8b_1m_v5p       Qwen3 8B (YaRN to 1M positions) at 1M tokens per row on v5p-256:
                        sequence=32.
  llama3_8b_pp_2x_v5p   Llama 3.1 8B on two v5p-64 slices: pipeline stages over DCN (one
                        per slice, 8 GPipe microbatches), FSDP inside each slice.
  kimi_k2_1t            Kimi K2 (1T MoE, MLA) on v5p-1024 (512 chips).
  deepseek_v3_671b      DeepSeek-V3 (671B MoE, MLA) on v5p-1024.
  qwen3_235b_a22b       Qwen3-235B-A22B (MoE) on v5p-256.
Override any field: --config.optimizer.learning_rate=1e-5 --config.data.batch_size=64
"""

import os

import ml_collections

_DEMO = os.path.join(os.path.dirname(__file__), "..", "posttrain", "demo", "assets")


def _source(path, weight=1.0, domain="default", fmt="auto"):
    return ml_collections.ConfigDict(
        {"path": path, "weight": weight, "domain": domain, "format": fmt}
    )


# Long-context plans: model preset, tokens per row, rows per step, sequence-parallel chips.
LONG_PLANS = {
    "llama3_8b_128k_v5p": {"model": "llama3_8b", "length": 131_072, "rows": 4, "sequence": 8},
    "qwen3_8b_1m_v5p": {"model": "qwen3_8b_1m", "length": 1_048_576, "rows": 4, "sequence": 32},
}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.method = "sft"  # which driver runs this config
    # Model: a posttrain preset trained from random init, or an HF directory (wins if set).
    c.model = ml_collections.ConfigDict()
    c.model.preset = "tiny"  # posttrain.models preset when hf_path is empty
    c.model.hf_path = ""  # HF model directory (config.json + safetensors)
    c.model.checkpoint = ""  # or an earlier run's workdir: start from its latest params
    c.model.attention = ""  # "" keeps the model's (auto); xla | flash | cudnn | splash
    c.model.remat = ""  # "" keeps the model's; none | full | dots | dots_no_batch
    c.model.compute_dtype = ""  # "" keeps the model's; float32 | bfloat16
    c.model.param_dtype = ""  # "" keeps the model's; float32 | bfloat16
    c.model.logits_chunk = -1  # positions of a row whose logits a loss builds at once (0: all)
    c.model.context_parallel = ""  # mesh sequence > 1: ring | all_gather ("" keeps the model's)
    c.model.pipeline_microbatches = 0  # mesh stage > 1: GPipe microbatches (0 keeps the model's)
    c.model.pipeline_remat = ""  # mesh stage > 1: "layers" or "stage" ("" keeps the model's)
    c.model.pipeline_schedule = ""  # mesh stage > 1: "gpipe" or "1f1b" ("" keeps the model's)
    # Zero-mismatch mode: sampler and trainer log-probs bitwise equal (slower; docs/rl.md)
    c.model.batch_invariant = False
    c.model.ep_capacity_factor = 0.0  # MoE: expert-parallel buffers over the balanced share (0: the
    # model's, worst-case buffers that never drop)
    c.model.routing_bias_rate = 0.0  # MoE: aux-loss-free balancing step (0: bias frozen)
    c.model.aux_loss_coef = 0.0  # MoE: load-balancing loss weight (0 keeps the model's)
    # Your own Flax NNX module instead of a preset (docs/models.md, configs/nnx.py): its builder
    # "package.module:function", called with rngs= and nnx_kwargs.
    c.model.nnx = ""
    c.model.nnx_kwargs = ml_collections.ConfigDict()  # the builder's keyword arguments
    # Params held fixed while the rest trains (regexes searched in param paths): e.g.
    # ["vision/(patch|position|layers)"] freezes a VLM's image encoder, ["vision"] its projector
    # too (docs/models.md); [] trains everything.
    c.model.freeze = []
    c.tokenizer = ""  # tokenizer directory; "" uses model.hf_path

    # Data: sources are mixed by weight; rows are packed to max_len.
    c.data = ml_collections.ConfigDict()
    c.data.sources = [_source("train.jsonl")]  # list of {path, weight, domain, format}; also
    # split and columns for a Hugging Face dataset folder (docs/training.md)
    c.data.max_len = 2048  # tokens per row
    c.data.batch_size = 64  # global rows per optimizer step (all hosts together)
    c.data.seed = 0  # shuffling and mixing seed
    c.data.packing = True  # first-fit pack several examples per row
    c.data.shuffle = True  # reshuffle every epoch
    c.data.num_epochs = ml_collections.config_dict.placeholder(int)  # None: repeat forever
    c.data.on_error = "raise"  # raise | skip malformed records (skipped ones are counted)
    c.data.overlong = "truncate"  # truncate | drop examples longer than max_len (counted)
    c.data.add_eos = True  # end text / completion examples with EOS
    c.data.mix_by = "records"  # source weights share out records | tokens (of the packed rows)
    # Several processes: each reads its share of the records (records) or every record,
    # packing the global batches and feeding its rows (rows: one process's batches on any).
    c.data.split_by = "records"
    # Curriculum (docs/data.md): phases replacing the weights, e.g. difficulty buckets from
    # `posttrain data stratify`: [{"weights": {"easy": 1}, "steps": 100}, {"weights": {"easy":
    # 1, "hard": 1}}] (steps need packing=False; or "examples"; the last phase: the rest).
    c.data.curriculum = []
    # Vision-language models: image slots per packed row (0: as many as max_len holds); an
    # example with more images is cut before the first that does not fit.
    c.data.max_images = 0
    c.eval_data = []  # held-out sources for the eval loss (same fields as data.sources)
    # An eval suite run at every eval step, logged as eval suite/<category>/<task>/<metric>:
    # "configs/eval.py:<preset>" (docs/eval.md); "" for none.
    c.eval_suite = ""

    # LoRA (docs/lora.md): train low-rank adapters on the frozen `model`; checkpoints hold
    # only the adapters (plus a pointer to the base); `posttrain export` merges them. Every
    # method takes it: SFT, DPO (reference: the base), reward models, GRPO/PPO (the policy).
    c.lora = ml_collections.ConfigDict()
    c.lora.enabled = False  # True: train adapters only; False: full fine-tune
    c.lora.rank = 8  # r of A [r, in] and B [r, out] (delta W = alpha / r * A^T B)
    c.lora.alpha = 16.0  # the update is scaled by alpha / rank
    c.lora.dropout = 0.0  # only 0: adapters are merged into each layer's weights
    # Regexes searched in layer weight paths such as "layers/attn/q", "layers/mlp/down",
    # "layers/moe/experts/up", "layers/attn/kv_b"; default: attention and dense MLP projections.
    c.lora.targets = ["attn/(q|k|v|o|q_a|q_b|kv_a|kv_b)$", "mlp/(gate|up|down)$"]
    # QLoRA: store the frozen base's layer matrices as "int8" (per-output-channel absmax) or
    # "nf4" (4-bit NormalFloat, absmax per block), dequantised layer by layer; "": as they are.
    c.lora.quantize = ""
    c.lora.quant_block = 0  # absmax block along the input dim; 0: int8 whole dim, nf4 64

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 1e-5  # peak learning rate
    c.optimizer.warmup_steps = 100  # linear warmup
    c.optimizer.schedule = "cosine"  # cosine | linear | constant decay after warmup
    c.optimizer.end_lr_ratio = 0.1  # final lr / peak lr
    c.optimizer.weight_decay = 0.0  # AdamW decoupled decay on weight matrices
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.95
    c.optimizer.eps = 1e-8
    c.optimizer.grad_clip = 1.0  # global-norm clipping (0: off)
    c.optimizer.mu_dtype = ""  # Adam's first moment: "" (the params' dtype) | bfloat16
    c.z_loss = 0.0  # weight of log(Z)^2

    c.train = ml_collections.ConfigDict()
    c.train.steps = 1000  # optimizer steps
    c.train.micro_batches = 1  # gradient accumulation inside each step
    c.train.log_every = 10  # train metrics cadence
    c.train.eval_every = 200  # held-out eval cadence (0: only at the end)
    c.train.eval_batches = 0  # batches per eval (0: the whole eval set)
    c.train.max_bad_steps = 5  # consecutive non-finite steps before stopping with a save
    c.train.seed = 0  # init / dropout seed
    c.train.progress = True  # progress bar
    c.train.step_timeout_s = 600.0  # multi-process: no progress this long stops the run (0: off)
    c.train.profile_steps = ""  # "N:M": jax.profiler trace of steps N..M into <workdir>/profile
    # Where metrics go: "jsonl" (always), "tensorboard", "wandb", "mlflow" (pip install
    # 'posttrain[wandb]' / 'posttrain[mlflow]'); W&B offline: WANDB_MODE=offline.
    c.train.log_to = ["jsonl", "tensorboard"]
    c.train.project = ""  # W&B project and MLflow experiment ("": "posttrain")
    c.train.run_name = ""  # the trackers' run name ("": the workdir's name)
    c.train.mlflow_uri = ""  # "": MLFLOW_TRACKING_URI, else a file store in <workdir>/mlruns
    # OpenTelemetry spans of every step (pip install 'posttrain[trace]'; docs/training.md): to
    # an OTLP collector at trace_endpoint (or OTEL_EXPORTER_OTLP_*), else <workdir>/traces.
    c.train.trace = False
    c.train.trace_endpoint = ""

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 200  # save every N steps (also at the end and on SIGTERM)
    c.checkpoint.keep_last = 3  # newest checkpoints kept (0: all of them)
    c.checkpoint.keep_best = 1  # lowest-eval-loss checkpoints kept in addition
    c.checkpoint.async_save = True  # write in the background

    # Mesh: sizes per axis inside a slice (ici) and across slices (dcn); -1 fills.
    c.mesh = ml_collections.ConfigDict()
    c.mesh.ici = {"data": 1, "stage": 1, "fsdp": -1, "expert": 1, "sequence": 1, "tensor": 1}
    c.mesh.dcn = {"data": 1, "stage": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}
    c.mesh.rules = []  # extra logical-axis rules: [[name, mesh_axis_or_list], ...]

    if preset == "tiny":
        c.model.preset = "tiny"
        c.model.remat = "dots_no_batch"  # on CPU also faster: no stacked per-layer residuals
        c.tokenizer = os.path.join(_DEMO, "tokenizer")
        c.data.sources = [_source(os.path.join(_DEMO, "train.jsonl"), domain="arithmetic")]
        c.eval_data = [_source(os.path.join(_DEMO, "eval.jsonl"), domain="arithmetic")]
        c.data.max_len = 128
        c.data.batch_size = 32
        c.optimizer.learning_rate = 3e-3
        c.optimizer.warmup_steps = 50
        c.optimizer.weight_decay = 0.01
        c.train.steps = 1500
        c.train.log_every = 20
        c.train.eval_every = 500
        c.checkpoint.every = 500
    elif preset == "llama3_8b_v5p":
        # 8B on v5p-64 (32 chips): FSDP over all chips, bf16 compute; the layers keep their
        # weight matmuls' outputs for the backward pass (73 of 95 GiB per chip, the roofline
        # step 17% shorter than full remat's: `posttrain compile ... --remat-sweep`).
        c.model.preset = "llama3_8b"
        c.model.remat = "dots_no_batch"
        c.data.max_len = 8192
        c.data.batch_size = 128
        c.train.micro_batches = 2
        c.optimizer.learning_rate = 1e-5
        c.mesh.ici = {"data": 1, "fsdp": -1, "expert": 1, "sequence": 1, "tensor": 1}
    elif preset in LONG_PLANS:
        # Long rows: the length split over `sequence` (ring attention: each chip holds its
        # share of every row and passes keys around), the rest over fsdp; full remat, logits
        # in chunks of 4096 positions per row (512 per chip at sequence=8).
        plan = LONG_PLANS[preset]
        c.model.preset = plan["model"]
        c.model.remat = "full"
        c.model.logits_chunk = 4096
        c.model.context_parallel = "ring"
        c.data.max_len = plan["length"]
        c.data.batch_size = plan["rows"]
        c.optimizer.learning_rate = 1e-5
        c.mesh.ici = {"data": 1, "fsdp": -1, "expert": 1, "sequence": plan["sequence"],
                      "tensor": 1}  # fmt: skip
    elif preset == "llama3_8b_pp_2x_v5p":
        # Two slices joined over DCN: the 32 layers split in two stages, one per slice (only
        # activations cross the slow links, once per microbatch); FSDP over each slice's 32
        # chips; 8 microbatches of 32 rows: bubble 1/9 of the step.
        # `posttrain compile --config=configs/sft.py:llama3_8b_pp_2x_v5p --topology=v5p-64
        #  --num-slices=2`
        c.model.preset = "llama3_8b"
        c.model.remat = "full"
        c.model.pipeline_microbatches = 8
        # 8 rows x 8192 positions x 128k vocabulary logits per chip are 47 GiB unchunked
        c.model.logits_chunk = 2048
        c.data.max_len = 8192
        c.data.batch_size = 256
        c.optimizer.learning_rate = 1e-5
        c.mesh.ici = {"data": 1, "fsdp": -1, "expert": 1, "sequence": 1, "tensor": 1}
        c.mesh.dcn = {"stage": 2}
    elif preset == "llama3_70b_v5p":
        # 70B on v5p-256 (128 chips): FSDP over all chips, bf16 compute, the weight matmuls'
        # outputs kept (83 of 95 GiB per chip; remat=full needs 32 GiB and recomputes the
        # forward); `posttrain compile --topology=v5p-256 --remat-sweep` compares them.
        c.model.preset = "llama3_70b"
        c.model.remat = "dots_no_batch"
        c.data.max_len = 4096
        c.data.batch_size = 256
        c.train.micro_batches = 2  # 128 rows per micro-batch: one per chip
        c.optimizer.learning_rate = 5e-6
        c.mesh.ici = {"data": 1, "fsdp": -1, "expert": 1, "sequence": 1, "tensor": 1}
    elif preset == "qwen3_32b_v5p":
        # 32B on v5p-256 (128 chips): FSDP x tensor=4 inside the slice, the weight matmuls'
        # outputs kept (64 of 95 GiB per chip).
        c.model.preset = "qwen3_32b"
        c.model.remat = "dots_no_batch"
        c.data.max_len = 8192
        c.data.batch_size = 256
        c.train.micro_batches = 4
        c.optimizer.learning_rate = 5e-6
        c.mesh.ici = {"data": 1, "fsdp": -1, "expert": 1, "sequence": 1, "tensor": 4}
    elif preset == "gemma3_27b_v5p":
        # Gemma 3 27B (text) on v5p-32 (16 chips): FSDP over all chips, full remat, bf16
        # compute; its 262k-token vocabulary's logits 2048 positions of a row at a time.
        c.model.preset = "gemma3_27b"
        c.model.remat = "full"
        c.model.logits_chunk = 2048
        c.data.max_len = 8192
        c.data.batch_size = 64
        c.train.micro_batches = 4  # 16 rows per micro-batch: one per chip
        c.optimizer.learning_rate = 5e-6
        c.mesh.ici = {"data": 1, "fsdp": -1, "expert": 1, "sequence": 1, "tensor": 1}
    elif preset in MOE_PLANS:
        # Sparse MoE: experts split over `expert` (all-to-all dispatch), every other weight
        # over fsdp x expert, one row per chip per micro-batch, full remat, bf16 compute.
        # `posttrain compile --config=configs/sft.py:<preset> --topology=<slice>` checks the fit.
        plan = MOE_PLANS[preset]
        c.model.preset = plan["model"]
        c.model.remat = "full"
        c.model.ep_capacity_factor = 2.0  # buffers for 2x the balanced load; overflow counted
        c.data.max_len = 4096
        c.data.batch_size = plan["chips"] * plan["micro_batches"]
        c.train.micro_batches = plan["micro_batches"]
        c.optimizer.learning_rate = 2e-6
        c.mesh.ici = {"data": 1, "fsdp": -1, "expert": plan["expert"], "sequence": 1, "tensor": 1}
        c.mesh.rules = [["embed", ["fsdp", "expert"]]]
    else:
        names = ["tiny", "llama3_8b_v5p", "llama3_70b_v5p", "qwen3_32b_v5p", "gemma3_27b_v5p"]
        names += list(LONG_PLANS)
        names += ["llama3_8b_pp_2x_v5p"]
        names += list(MOE_PLANS)
        raise ValueError(f"unknown sft preset {preset!r}: {', '.join(names)}")
    return c


# The MoE presets' slices: chips, expert-parallel ways (a divisor of the experts) and
# micro-batches per step.
MOE_PLANS = {
    "kimi_k2_1t": dict(model="kimi_k2_1t", chips=512, expert=64, micro_batches=2),  # v5p-1024
    "deepseek_v3_671b": dict(
        model="deepseek_v3_671b", chips=512, expert=64, micro_batches=2
    ),  # v5p-1024 (v5p-512 needs 107 GiB per chip)
    "qwen3_235b_a22b": dict(
        model="qwen3_235b_a22b", chips=128, expert=32, micro_batches=4
    ),  # v5p-256
}
