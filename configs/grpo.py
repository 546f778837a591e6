"""RL with verifiable rewards: GRPO and its family (Dr.GRPO, DAPO, GSPO, RLOO).

    make demo                                                    # writes runs/demo/sft
    posttrain train --config=configs/grpo.py:tiny --workdir=runs/grpo_tiny     # CPU

Presets:
  tiny          GRPO on the demo's arithmetic problems from the demo's SFT model (runs/demo/sft);
                the verifier is the reward (domain "arithmetic").
  dapo_tiny     DAPO: asymmetric clip (0.2, 0.28), token-mean loss, dynamic sampling, overlong
                shaping, truncated completions masked, no KL.
  drgrpo_tiny   Dr.GRPO: no std scaling, sequence sums normalised by a constant length.
  gspo_tiny     GSPO: sequence-level importance ratio.
  kimi_k2_1t    Kimi K2 (1T MoE) GRPO on v5p-1024: policy, reference and KV cache.
  rloo_tiny     RLOO: leave-one-out baseline.
  qwen3_8b_v5p  GRPO for Qwen3 8B on a v5p-64 slice (set model.hf_path / checkpoint, data).
  qwen3_8b_32k_v5p  the same with 32k-token rollouts (1k prompt + 31k completion): rows split
                over sequence=4 (ring attention), logits in chunks.
  gemma3_4b_vlm_v5p  GRPO with image prompts for Gemma 3 4B (image-text) on a v5p-8 slice:
                prompts of up to 2 images (256 tokens each) and text, numeric answers
                (domain "math": chart or geometry questions), the SigLIP encoder frozen (its
                projector and the decoder train); set model.hf_path and data.
Every field of configs/sft.py applies (model, data, optimizer, train, checkpoint, mesh);
`data.batch_size` is prompts per RL step, `train.steps` RL steps. Prompt records:
{"prompt": str or messages, "domain": ..., plus the fields the domain's reward reads}.
"""

import os

import ml_collections

from posttrain.config import load_config_file, override

_HERE = os.path.dirname(os.path.abspath(__file__))
_DEMO = os.path.join(_HERE, "..", "posttrain", "demo", "assets")

# Algorithm presets: overrides of the GRPO defaults below.
VARIANTS = {
    "grpo": {},
    "dapo": {
        "loss.clip_high": 0.28,
        "loss.aggregation": "token-mean",
        "loss.mask_truncated": True,
        "rollout.dynamic_sampling": True,
        "kl.coef": 0.0,
    },
    "drgrpo": {"algorithm.advantage": "drgrpo", "loss.aggregation": "seq-mean-token-sum-norm"},
    "gspo": {"loss.ratio": "sequence", "loss.clip_low": 3e-4, "loss.clip_high": 4e-4},
    "rloo": {"algorithm.advantage": "rloo"},
}


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    variant, _, size = preset.rpartition("_") if preset.endswith("_tiny") else ("grpo", "", preset)
    sizes = ("tiny", "qwen3_8b_v5p", "qwen3_8b_32k_v5p", "kimi_k2_1t", "gemma3_4b_vlm_v5p")
    if size not in sizes or variant not in VARIANTS:
        names = [f"{v}_tiny" for v in VARIANTS if v != "grpo"]
        raise ValueError(
            f"unknown grpo preset {preset!r}: tiny, {', '.join(names)}, {', '.join(sizes[1:])}"
        )
    base = {"tiny": "tiny", "kimi_k2_1t": "kimi_k2_1t"}.get(size, "llama3_8b_v5p")
    c = load_config_file(os.path.join(_HERE, "sft.py") + ":" + base)
    c.method = "grpo"
    del c["z_loss"]
    del c["eval_suite"]  # the SFT driver's periodic eval suite
    c.data.packing = False
    c.data.on_error = "skip"

    c.rollout = ml_collections.ConfigDict()
    c.rollout.num_generations = 8  # completions per prompt (group size)
    c.rollout.max_prompt_len = 512  # longer prompts are skipped (counted)
    # {domain: tokens}: prompts of these domains over budget keep the question and the most
    # relevant passages of their record's "document" (dynamic truncation) instead of being skipped
    c.rollout.fit_documents = {}
    c.rollout.max_new_tokens = 1024  # completion budget
    c.rollout.sampling = ml_collections.ConfigDict()  # how each token is drawn
    c.rollout.sampling.temperature = 1.0  # 0 is greedy; > 0 samples softmax(logits / T)
    c.rollout.sampling.top_p = 1.0  # nucleus mass kept, in (0, 1]
    c.rollout.sampling.top_k = 0  # keep the k likeliest tokens; 0 keeps all
    c.rollout.dynamic_sampling = False  # drop groups whose rewards are all equal, refill (DAPO)
    c.rollout.max_refills = 4  # extra prompt batches per step for refilling
    c.rollout.overlong_buffer = 0  # DAPO soft over-length penalty ramp, tokens (0: off)
    c.rollout.sampler_devices = 0  # > 0: sample on the last N devices, train on the rest
    # Several hosts, co-located: each samples its share with its own copy of the weights
    # (per_process: the model fits a host), or one engine over the training mesh samples
    # every prompt on every host, the weights sharded as trained (global).
    c.rollout.sampler_mesh = "per_process"
    c.rollout.max_staleness = 0  # decoupled: rollouts may use weights this many steps old
    # Decoupled: partial rollouts, in-flight weight updates: a step takes the groups that finish
    # first, the rest continue on newer weights (each token's version within max_staleness).
    c.rollout.partial = False
    # Decoupled: sample with the newest weights sent (timing decides how new); False: fixed
    # versions (batch i: step i - 1 - max_staleness's; partial: one newer), reproducible.
    c.rollout.newest_weights = True
    # The paged engine every rollout decodes on: continuous batching, a group's samples share
    # its prompt's prefill and KV blocks (loss.router_replay turns on its route recording).
    c.rollout.engine = ml_collections.ConfigDict()
    c.rollout.engine.slots = 0  # sequences decoded together; 0: data.batch_size x num_generations
    c.rollout.engine.block_size = 16  # tokens per KV block
    c.rollout.engine.num_blocks = 0  # KV pool blocks; 0: room for every row's longest sequence
    c.rollout.engine.chunk = 16  # decode steps per device call (rows refill between calls)
    c.rollout.engine.prefill_bucket = 16  # prompts padded to a multiple of this for prefill
    c.rollout.engine.kv_dtype = "auto"  # auto (compute dtype) | int8 | int8_layered
    c.rollout.engine.kv_recent = 32  # int8_layered: each row's last N tokens in full precision
    c.rollout.engine.prefix_sharing = True  # a group's samples share its prompt's prefill
    c.rollout.engine.attention = "auto"  # auto | xla (gather blocks) | ragged (the TPU kernel)
    c.rollout.engine.unstack_layers = True  # per-layer weight copy per decode call (faster)
    c.rollout.engine.speculative = 0  # prompt-lookup draft tokens a round (0: plain decoding)

    # Multi-turn episodes with tools (agentic RL, docs/agents.md): name "" = single-turn.
    c.env = ml_collections.ConfigDict()
    c.env.name = ""  # calculator | python_tool | terminal | fault_injection | a registered one
    c.env.options = {}  # the environment's arguments (e.g. {"timeout_s": 5.0})
    c.env.max_turns = 8  # model turns per episode
    c.env.turn_tokens = 0  # sampled tokens per turn (0: rollout.max_new_tokens, the episode's)
    c.env.max_tool_s = 120.0  # seconds of tool calls per episode
    c.env.tool_format = "auto"  # hermes | llama3_json | mistral | auto (from the chat template)
    c.env.fault_rate = 0.0  # > 0: tool calls fail this often (timeouts, errors, empty results)
    c.env.workers_min = 0  # the tool worker pool shrinks to this many threads when idle
    c.env.workers_max = 8  # and grows to this many while tool calls wait
    # Reward of episodes cut by a budget (None: scored like finished ones; 0 in an environment
    # registered with `rewards=True`).
    c.env.truncated_reward = ml_collections.config_dict.placeholder(float)

    c.algorithm = ml_collections.ConfigDict()
    c.algorithm.advantage = "grpo"  # grpo | drgrpo | rloo | none
    c.algorithm.unbiased_std = True  # GRPO group std with Bessel's correction (TRL)
    c.algorithm.std_eps = 1e-4
    c.algorithm.epochs = 1  # passes over each rollout batch
    c.algorithm.minibatches = 1  # optimizer updates per pass
    c.algorithm.fuse_old_logps = True  # one update per batch: old log-probs from its forward

    c.loss = ml_collections.ConfigDict()
    c.loss.clip_low = 0.2  # ratio >= 1 - clip_low
    c.loss.clip_high = 0.2  # ratio <= 1 + clip_high
    c.loss.dual_clip = 0.0  # > 1 caps negative-advantage token losses (0: off)
    c.loss.ratio = "token"  # token | sequence (GSPO)
    c.loss.aggregation = "seq-mean-token-mean"  # | token-mean | seq-mean-token-sum-norm
    c.loss.mask_truncated = False  # no loss on completions cut at max_new_tokens
    c.loss.kl_estimator = "k3"  # k1 | k2 | k3
    c.loss.entropy_coef = 0.0  # entropy bonus (always logged)
    # Off-policy correction against the sampler's log-probs (docs/rl.md "Off-policy
    # corrections"): the ratio p_old / p_sampler per token | sequence (product) | geometric
    # (per-token geometric mean), used to truncate (TIS: weight min(ratio, tis_cap)), mask
    # (weight ratio, dropped outside [is_low, is_high]; token level: IcePop) or reject (weight 1,
    # dropped outside the bounds).
    c.loss.correction = "off"  # off | token | sequence | geometric
    c.loss.correction_mode = "truncate"  # truncate | mask | reject
    c.loss.tis_cap = 0.0  # truncate: the weight's cap (e.g. 2.0)
    c.loss.is_low = 0.5  # mask / reject: lower bound of the kept ratios
    c.loss.is_high = 2.0  # mask / reject: upper bound
    # MoE router replay of the sampler's routing: off | logprob (old-policy and reference
    # passes) | update (also the update's loss pass); logs router_mismatch.
    c.loss.router_replay = "off"

    c.kl = ml_collections.ConfigDict()
    c.kl.mode = "loss"  # loss: a per-token loss term | reward: a per-token reward penalty
    c.kl.coef = 0.0  # KL(policy || reference) weight; 0 (and no target): no reference model
    c.kl.target = 0.0  # > 0: adaptive coefficient toward this per-token KL
    c.kl.horizon = 1000
    c.kl.domain_scale = {}  # {domain: multiplier of the coefficient}

    # On-policy distillation (teacher "": off): the policy samples, the teacher scores each
    # sampled token; per-token advantage coef (teacher_logp - student_logp) + reward_coef A.
    c.distill = ml_collections.ConfigDict()
    c.distill.teacher = ""  # a run's workdir or an HF model directory (same vocabulary)
    c.distill.coef = 1.0  # weight of the per-token distillation advantage
    c.distill.reward_coef = 0.0  # weight of the task reward's advantage (0: pure distillation)
    c.distill.teacher_devices = 0  # > 0: the teacher on its own N devices (0: training mesh)

    c.rewards = ml_collections.ConfigDict()
    c.rewards.domains = {}  # {domain: ["module:function[?opt=v]" | "rm:<path>", ...]}; {}: built-in
    c.rewards.workers = 2  # verifier processes
    c.rewards.timeout_s = 10.0
    c.rewards.pass_threshold = 1.0  # reward >= this counts as a pass

    # Offline phase before online RL: rejection-sampling fine-tuning (0 steps: off).
    c.rft = ml_collections.ConfigDict()
    c.rft.steps = 0  # SFT steps on the policy's own verified-correct completions
    c.rft.prompts = 1024  # training prompts sampled
    c.rft.samples = 8  # completions per prompt
    c.rft.batch_size = 32  # SFT rows per step
    c.rft.learning_rate = 1e-5

    # Offline RL from logged trajectories before online RL (0 steps: off); after RFT if both.
    c.offline = ml_collections.ConfigDict()
    c.offline.data = []  # .jsonl/.parquet files or globs: {prompt, completion, reward, ...}
    c.offline.objective = "awr"  # awr | grpo_is (importance-sampled; needs logged logprobs)
    c.offline.steps = 0  # optimizer steps of the offline stage
    c.offline.batch_size = 32  # logged completions per step
    c.offline.learning_rate = 1e-5  # the stage's optimizer rate (no warmup)
    c.offline.beta = 1.0  # awr: weight exp(advantage / beta)
    c.offline.max_weight = 20.0  # awr: weight cap
    c.offline.tis_cap = 2.0  # grpo_is: importance weight cap

    # Domains: static source weights, or weights that follow each domain's learning signal.
    c.domains = ml_collections.ConfigDict()
    c.domains.adaptive = False
    c.domains.smoothing = 0.9  # exponential average of the share of groups whose rewards differ
    c.domains.floor = 0.1  # every domain keeps a little weight, so its signal stays measured
    # Grouped domain updates (docs/rl.md): every step's prompts from one domain, drawn by weight.
    c.domains.grouped = False
    c.domains.normalise_advantages = False  # divide each domain's advantages by their batch std
    c.domains.lr_scale = {}  # {domain: learning-rate multiplier} for updates on its rows

    # Stability alerts (a warning in the log and `alert/*` metrics).
    c.monitor = ml_collections.ConfigDict()
    c.monitor.entropy_collapse = 0.1  # entropy below this x its first steps' mean (0: off)
    c.monitor.kl_max = 0.0  # mean KL above this (0: off)
    c.monitor.warmup = 3  # steps whose mean entropy is the baseline

    # Difficulty filtering before RL (0 samples: off): keep prompts the start policy sometimes,
    # but not always, solves.
    c.difficulty = ml_collections.ConfigDict()
    c.difficulty.samples = 0  # completions per prompt for the pass-rate estimate
    c.difficulty.prompts = 0  # estimate the first N prompts (0: all); the rest are kept
    c.difficulty.min_pass_rate = 0.0  # dropped at or below (too hard)
    c.difficulty.max_pass_rate = 1.0  # dropped at or above (too easy)

    c.optimizer.learning_rate = 1e-6
    c.optimizer.warmup_steps = 10
    c.optimizer.schedule = "constant"
    c.optimizer.weight_decay = 0.0

    if size == "tiny":
        c.model.checkpoint = os.path.join("runs", "demo", "sft")
        c.data.sources = [
            {"path": os.path.join(_DEMO, "train.jsonl"), "weight": 1.0,
             "domain": "arithmetic", "format": "auto"}
        ]  # fmt: skip
        c.eval_data = [{**c.data.sources[0], "path": os.path.join(_DEMO, "eval.jsonl")}]
        c.data.batch_size = 32
        c.rollout.max_prompt_len = 32
        c.rollout.max_new_tokens = 8
        c.optimizer.learning_rate = 2e-5
        c.train.steps = 100
        c.train.log_every = 1
        c.train.eval_every = 50
        c.checkpoint.every = 50
    elif size == "kimi_k2_1t":
        # Kimi K2 on the SFT plan's v5p-1024 slice (expert=64 x fsdp=8): the policy's train
        # state, its frozen reference and the co-located sampler's KV cache (MLA: one latent
        # per token) side by side. 128 prompts x 16 samples, 4 updates of 512 rows (one per chip).
        c.data.sources = [
            {"path": "prompts.jsonl", "weight": 1.0, "domain": "math", "format": "auto"}
        ]
        c.eval_data = []
        c.data.batch_size = 128
        c.rollout.num_generations = 16
        c.rollout.max_prompt_len = 1024
        c.rollout.max_new_tokens = 4096
        c.algorithm.minibatches = 4
        c.train.micro_batches = 1
        c.train.steps = 200
        c.kl.coef = 0.001
        # No host holds the model: one engine over the whole slice samples every prompt on
        # every host. Its rows and KV pool are replicated over the batch axes, so 16 rows decode
        # at once (the rest wait for a row to finish): 82.5 of 95 GiB per chip (docs/compile.md).
        c.rollout.sampler_mesh = "global"
        c.rollout.engine.slots = 16
    elif size == "gemma3_4b_vlm_v5p":
        # 16 image prompts x 8 samples per step on 4 v5p chips (FSDP): the policy, its frozen
        # reference and the sampler's KV cache; image pixels ride in the rollout batch.
        c.model.preset = "gemma3_4b_vlm"
        # Matmul outputs kept: 59.9 of 95 GiB per chip, no forward run twice (full: 39.8 GiB, a
        # 1.27x longer roofline step; docs/compile.md).
        c.model.remat = "dots_no_batch"
        c.model.logits_chunk = 1024  # (a 262k vocabulary)
        c.model.freeze = ["vision/(patch|position|layers)"]  # the SigLIP encoder stays fixed
        c.data.max_images = 2  # image slots per rollout row
        c.data.sources = [
            {"path": "image_prompts.jsonl", "weight": 1.0, "domain": "math", "format": "auto"}
        ]
        c.eval_data = []
        c.data.batch_size = 16
        c.rollout.num_generations = 8
        c.rollout.max_prompt_len = 1024
        c.rollout.max_new_tokens = 1024
        c.rollout.engine.slots = 32  # (the engine's rows replicated: 48.5 of 95 GiB per chip)
        c.algorithm.minibatches = 4
        c.train.micro_batches = 2
        c.train.steps = 300
        c.kl.coef = 0.001
    else:
        c.model.preset = "qwen3_8b"
        c.data.sources = [
            {"path": "prompts.jsonl", "weight": 1.0, "domain": "math", "format": "auto"}
        ]
        c.eval_data = []
        c.data.batch_size = 64
        c.rollout.num_generations = 16
        c.rollout.max_new_tokens = 4096
        c.algorithm.minibatches = 4
        c.train.micro_batches = 4
        c.train.steps = 500
        c.kl.coef = 0.001
        # The engine's rows and KV pool are replicated over the batch axes: 32 rows decode at
        # once on the training mesh, 73.1 of 95 GiB per chip (docs/compile.md).
        c.rollout.engine.slots = 32
        if size == "qwen3_8b_32k_v5p":
            # Long reasoning rollouts: 8 prompts x 8 samples of up to 32k tokens; the train
            # step's rows split over sequence=4 x fsdp=8, one row per fsdp group per micro-batch;
            # full remat (the saved matmul outputs of 32k-token rows would not fit).
            c.model.remat = "full"
            c.model.logits_chunk = 4096
            c.mesh.ici = {"data": 1, "fsdp": -1, "expert": 1, "sequence": 4, "tensor": 1}
            c.data.batch_size = 8
            c.rollout.num_generations = 8
            c.rollout.max_prompt_len = 1024
            c.rollout.max_new_tokens = 31_744
            c.algorithm.minibatches = 2
            c.rollout.engine.slots = 4  # (rows of 32k tokens: 55.9 of 95 GiB per chip)
    return override(c, VARIANTS[variant])
