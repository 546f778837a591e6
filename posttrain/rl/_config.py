"""The RL run's configuration: rollouts, algorithm, critic, KL, rewards, domains, offline
stages, and the whole run (`RLConfig`, what `configs/grpo.py` and `configs/ppo.py` build)."""

import dataclasses
from typing import ClassVar

from posttrain.config import ConfigError
from posttrain.data import DataConfig, SourceConfig
from posttrain.envs import env_names
from posttrain.lora import LoRAConfig
from posttrain.losses import (
    ADVANTAGE_MODES,
)
from posttrain.models import ModelSpec
from posttrain.parallel import MeshConfig
from posttrain.rewards import (
    RewardRegistry,
    default_registry,
)
from posttrain.rl._loss import PolicyLossConfig
from posttrain.sampling import EngineConfig, SamplingParams
from posttrain.train import CheckpointConfig, LoopConfig, OptimizerConfig


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    num_generations: int = 8  # completions per prompt (the group size G)
    max_prompt_len: int = 512  # longer prompts are left out (counted)
    # {domain: tokens}: a prompt of these domains over its budget (or max_prompt_len) keeps
    # the question and the passages of its record's "document" most relevant to it, as many
    # as fit (dynamic truncation), instead of being left out
    fit_documents: dict = dataclasses.field(default_factory=dict)
    max_new_tokens: int = 512  # completion budget; cut completions count as truncated
    sampling: SamplingParams = SamplingParams(temperature=1.0)  # how each token is drawn
    dynamic_sampling: bool = False  # DAPO: drop all-equal-reward groups, draw prompts to refill
    max_refills: int = 4  # extra prompt batches one step may draw to refill
    overlong_buffer: int = 0  # DAPO soft over-length penalty ramp in tokens (0: off)
    # Decoupled rollouts: > 0 puts the sampler on the last N devices (the rest train), with
    # its own copy of the weights, sent after every step; 0 samples on the training devices.
    sampler_devices: int = 0
    max_staleness: int = 0  # decoupled: rollouts may come from weights this many steps old
    # Decoupled: sample with the newest weights sent (how new depends on timing), or False:
    # batch i with exactly those of step i - 1 - max_staleness (reproducible run to run; the
    # sampler then holds up to max_staleness + 1 versions of the weights).
    newest_weights: bool = True
    # Several processes, co-located: each samples its share of the prompts with its own copy
    # of the weights on its own devices ("per_process": the model must fit one host), or
    # every process runs one engine over the training mesh on every prompt, the weights
    # sharded as trained ("global": for models bigger than a host).
    sampler_mesh: str = "per_process"
    # Decoupled: partial rollouts with in-flight weight updates (docs/rl.md): a step trains on
    # the groups that finish first; the others continue on the newer weights.
    partial: bool = False
    # The paged engine every rollout decodes on (continuous batching; a group's samples share
    # its prompt's prefill and KV blocks). slots 0: a step's batch x num_generations (x2 with
    # partial rollouts); record_routes follows loss.router_replay.
    engine: EngineConfig = EngineConfig(slots=0)

    # Keys this section had: what to set instead (`posttrain.config.build` names it).
    RETIRED_KEYS: ClassVar[dict[str, str]] = {
        "engine_slots": "set rollout.engine.slots",
        "kv_block_size": "set rollout.engine.block_size",
        "kv_dtype": "set rollout.engine.kv_dtype",
        "unstack_layers": "set rollout.engine.unstack_layers",
        "sampler": (
            "every rollout decodes on the engine (rollout.engine); the old 'static' sampler's "
            "padded batch is rollout.engine.block_size >= max_prompt_len + max_new_tokens (one "
            "block per row) with rollout.engine.prefix_sharing=False"
        ),
    }

    def __post_init__(self):
        if self.engine.record_routes:
            raise ConfigError(
                "rollout.engine.record_routes follows loss.router_replay: leave it unset"
            )
        if self.num_generations < 1 or self.max_new_tokens < 1 or self.max_prompt_len < 1:
            raise ConfigError("rollout: num_generations, max_new_tokens, max_prompt_len >= 1")
        if self.overlong_buffer < 0 or self.overlong_buffer > self.max_new_tokens:
            raise ConfigError("rollout.overlong_buffer must be in [0, max_new_tokens]")
        if self.sampler_devices < 0 or self.max_staleness < 0:
            raise ConfigError("rollout.sampler_devices and rollout.max_staleness must be >= 0")
        if self.max_staleness and not self.sampler_devices:
            raise ConfigError("rollout.max_staleness needs decoupled rollouts (sampler_devices)")
        if self.partial and not self.sampler_devices:
            raise ConfigError(
                "rollout.partial needs decoupled rollouts: set rollout.sampler_devices > 0"
            )
        if self.sampler_mesh not in ("per_process", "global"):
            raise ConfigError(
                f"rollout.sampler_mesh={self.sampler_mesh!r}: use 'per_process' or 'global'"
            )
        if self.sampler_mesh == "global" and self.sampler_devices:
            raise ConfigError(
                "rollout.sampler_mesh='global' is for a co-located sampler (on the training "
                "mesh); a decoupled one (rollout.sampler_devices) samples per process"
            )
        if self.partial and self.dynamic_sampling:
            raise ConfigError("rollout.partial does not combine with dynamic_sampling yet")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Multi-turn episodes (agentic RL): each rollout is an episode of an environment
    (`posttrain.envs`) instead of one completion; rollout.max_new_tokens bounds an episode's
    tokens after the prompt (sampled and observed), the row's length is unchanged."""

    name: str = ""  # "" single-turn; else a registered environment (calculator, python_tool, ...)
    options: dict = dataclasses.field(default_factory=dict)  # the environment's arguments
    max_turns: int = 8  # model turns per episode
    turn_tokens: int = 0  # sampled tokens per turn (0: rollout.max_new_tokens)
    max_tool_s: float = 120.0  # tool seconds per episode
    tool_format: str = "auto"  # hermes | llama3_json | mistral | auto (from the chat template)
    fault_rate: float = 0.0  # > 0: tool calls fail this often (fault_injection)
    workers_min: int = 0  # the environment worker pool's bounds (threads)
    workers_max: int = 8
    # Episodes cut by a budget: their reward (None: scored as finished ones are) and whether
    # they carry loss (loss.mask_truncated also masks them).
    truncated_reward: float | None = None

    def __post_init__(self):
        if self.name and self.name not in env_names():
            raise ConfigError(
                f"env.name={self.name!r} is not an environment; use one of {env_names()} or "
                "register yours (posttrain.envs.register_env)"
            )
        if self.max_turns < 1 or self.turn_tokens < 0 or self.max_tool_s <= 0:
            raise ConfigError("env: max_turns >= 1, turn_tokens >= 0 and max_tool_s > 0")
        if not 0 <= self.fault_rate <= 1:
            raise ConfigError(f"env.fault_rate must be in [0, 1], got {self.fault_rate}")
        if not 0 <= self.workers_min <= self.workers_max or self.workers_max < 1:
            raise ConfigError("env: 0 <= workers_min <= workers_max and workers_max >= 1")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    # grpo | drgrpo (no std scaling) | rloo (leave-one-out) | none | gae (PPO, with a critic)
    advantage: str = "grpo"
    unbiased_std: bool = True  # GRPO's group std (torch.std default, as TRL)
    std_eps: float = 1e-4  # added to the group std
    gamma: float = 1.0  # GAE discount
    lam: float = 0.95  # GAE lambda
    whiten_advantages: bool = True  # GAE: whiten advantages over the batch's tokens
    epochs: int = 1  # passes over each rollout batch (PPO epochs)
    minibatches: int = 1  # optimizer updates per pass
    # One update per rollout batch: the old policy is the one being updated, so its log-probs
    # come from the update's own forward (stop-gradient) instead of a separate pass first.
    fuse_old_logps: bool = True

    def __post_init__(self):
        if self.advantage not in (*ADVANTAGE_MODES, "gae"):
            raise ConfigError(f"algorithm.advantage: use one of {(*ADVANTAGE_MODES, 'gae')}")
        if self.epochs < 1 or self.minibatches < 1:
            raise ConfigError("algorithm.epochs and algorithm.minibatches must be >= 1")


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """PPO's value model (used when algorithm.advantage is "gae")."""

    init: str = "policy"  # policy (its starting trunk, zero head) | rm:<reward model run>[#head]
    coef: float = 0.5  # value-loss weight
    clip: float = 0.2  # value clip around the rollout-time values (0: off)


@dataclasses.dataclass(frozen=True)
class KLConfig:
    mode: str = "loss"  # loss: a per-token loss term | reward: a per-token reward penalty (PPO)
    coef: float = 0.0  # KL penalty weight (0 with no target: no reference model)
    target: float = 0.0  # > 0: adapt coef toward this mean per-token KL (Ziegler et al.)
    horizon: int = 1000  # the adaptive controller's horizon, in RL steps
    domain_scale: dict = dataclasses.field(default_factory=dict)  # {domain: coef multiplier}

    def __post_init__(self):
        if self.mode not in ("loss", "reward"):
            raise ConfigError(f"kl.mode={self.mode!r}: use loss or reward")

    @property
    def enabled(self) -> bool:
        return self.coef > 0 or self.target > 0


@dataclasses.dataclass(frozen=True)
class RewardsConfig:
    # {domain: [reward reference, ...]} ("module:function" or "rm:<path>[#head]"), each
    # weight 1; empty: the built-in registry (math, code, format, tool_call, arithmetic).
    domains: dict = dataclasses.field(default_factory=dict)
    workers: int = 2  # verifier processes
    timeout_s: float = 10.0  # per completion
    pass_threshold: float = 1.0  # a completion "passes" with reward >= this (pass-rate metric)

    def registry(self) -> RewardRegistry:
        if not self.domains:
            return default_registry()
        registry = RewardRegistry()
        for domain, refs in self.domains.items():
            for ref in [refs] if isinstance(refs, str) else refs:
                registry.register(domain, ref)
        return registry


@dataclasses.dataclass(frozen=True)
class DomainsConfig:
    """How prompts are drawn across domains."""

    adaptive: bool = False  # False: the sources' static weights; True: follow learning signal
    smoothing: float = 0.9  # adaptive: exponential average of each domain's signal
    floor: float = 0.1  # adaptive: every domain keeps at least this share of its base weight
    # Grouped domain updates: each RL step's prompts (so each of its updates) come from one
    # domain, drawn by the weights above.
    grouped: bool = False
    # Scale each domain's advantages by 1 / (their std over the step's batch), so domains with
    # different reward scales move the policy alike.
    normalise_advantages: bool = False
    lr_scale: dict = dataclasses.field(default_factory=dict)  # {domain: learning-rate multiplier}

    def __post_init__(self):
        if not (0 <= self.smoothing < 1 and self.floor > 0):
            raise ConfigError("domains.smoothing must be in [0, 1) and domains.floor > 0")
        if any(not v > 0 for v in self.lr_scale.values()):
            raise ConfigError(f"domains.lr_scale multipliers must be > 0, got {self.lr_scale}")


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    """Stability alerts in the log (and `alert/*` metrics): entropy collapse and runaway KL."""

    entropy_collapse: float = 0.1  # alert below this x the first `warmup` steps' mean (0: off)
    kl_max: float = 0.0  # alert above this mean KL (to the reference, else old-policy; 0: off)
    warmup: int = 3  # steps whose mean entropy is the baseline

    def __post_init__(self):
        if not (0 <= self.entropy_collapse < 1 and self.kl_max >= 0 and self.warmup >= 1):
            raise ConfigError(
                "monitor: entropy_collapse must be in [0, 1), kl_max >= 0 and warmup >= 1"
            )


@dataclasses.dataclass(frozen=True)
class DifficultyConfig:
    """Difficulty filtering before RL (0 samples: off): the starting policy answers each prompt
    `samples` times; prompts whose pass rate is not strictly between the bounds are dropped."""

    samples: int = 0  # completions per prompt to estimate pass rates (0: no filtering)
    prompts: int = 0  # only the first N prompts are estimated (0: all); the rest are kept
    min_pass_rate: float = 0.0  # at or below: too hard (no signal)
    max_pass_rate: float = 1.0  # at or above: too easy (no signal)


@dataclasses.dataclass(frozen=True)
class RFTConfig:
    """Rejection-sampling fine-tuning before online RL (0 steps: off): sample `samples`
    completions of `prompts` training prompts, keep those whose reward passes, SFT on them."""

    steps: int = 0  # SFT steps on the kept completions (0: no RFT stage)
    prompts: int = 1024  # training prompts sampled
    samples: int = 8  # completions per prompt
    batch_size: int = 32  # SFT rows per step
    learning_rate: float = 1e-5


OFFLINE_OBJECTIVES = ("awr", "grpo_is")


@dataclasses.dataclass(frozen=True)
class OfflineConfig:
    """Offline RL from logged trajectories before online RL (0 steps: off): JSONL/Parquet rows
    {prompt, completion, reward, optional logprobs (per completion token) or logprob (their
    sum), optional group}, trained with AWR or importance-sampled GRPO (docs/rl.md)."""

    data: tuple[str, ...] = ()  # files or globs of logged trajectories (.jsonl, .parquet)
    objective: str = "awr"  # awr (advantage-weighted regression) | grpo_is (needs logprobs)
    steps: int = 0  # optimizer steps of the offline stage (0: no offline stage)
    batch_size: int = 32  # logged completions per step
    learning_rate: float = 1e-5  # the stage's optimizer rate (no warmup; optimizer.* otherwise)
    beta: float = 1.0  # awr: weight temperature exp(A / beta), in reward units
    max_weight: float = 20.0  # awr: weights are capped here
    tis_cap: float = 2.0  # grpo_is: the importance weight min(pi / mu, tis_cap)

    def __post_init__(self):
        if self.objective not in OFFLINE_OBJECTIVES:
            raise ConfigError(
                f"offline.objective={self.objective!r}: use one of {OFFLINE_OBJECTIVES}"
            )
        if self.steps < 0 or self.batch_size < 1 or not self.learning_rate > 0:
            raise ConfigError("offline: steps must be >= 0, batch_size >= 1 and learning_rate > 0")
        if not (self.beta > 0 and self.max_weight > 0 and self.tis_cap > 0):
            raise ConfigError("offline: beta, max_weight and tis_cap must be > 0")
        if self.steps and not self.data:
            raise ConfigError(
                "offline.steps > 0 needs offline.data: the logged trajectory files "
                "(or set offline.steps=0)"
            )


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """On-policy distillation (teacher "": off): the policy samples, `teacher` scores every
    sampled token, and each token's advantage is `coef (teacher_logp - student_logp)` plus
    `reward_coef` times the task reward's advantage (docs/rl.md)."""

    teacher: str = ""  # a run's workdir (its latest checkpoint) or an HF model directory
    coef: float = 1.0  # weight of the per-token advantage teacher_logp - student_logp
    reward_coef: float = 0.0  # weight of the task reward's advantage (0: pure distillation)
    # > 0: the teacher runs on its own N devices (the last N before the sampler's, taken from
    # training); 0: it is sharded over the training devices beside the policy.
    teacher_devices: int = 0

    def __post_init__(self):
        if self.coef < 0 or self.reward_coef < 0 or self.teacher_devices < 0:
            raise ConfigError(
                "distill.coef, distill.reward_coef and distill.teacher_devices must be >= 0"
            )
        if self.teacher and not (self.coef or self.reward_coef):
            raise ConfigError("distill.coef and distill.reward_coef are both 0: set one > 0")
        if self.teacher_devices and not self.teacher:
            raise ConfigError("distill.teacher_devices is set without distill.teacher: set both")

    @property
    def enabled(self) -> bool:
        return bool(self.teacher)


@dataclasses.dataclass(frozen=True)
class RLConfig:
    model: ModelSpec = ModelSpec()  # the policy's start (and the frozen reference)
    tokenizer: str = ""  # tokenizer directory; default: model.hf_path
    data: DataConfig = None  # prompt sources; batch_size = prompts per RL step
    eval_data: tuple[SourceConfig, ...] = ()  # held-out prompts: greedy reward and pass rate
    rollout: RolloutConfig = RolloutConfig()
    env: EnvConfig = EnvConfig()  # multi-turn episodes with tools (name "" = single-turn)
    algorithm: AlgorithmConfig = AlgorithmConfig()
    critic: CriticConfig = CriticConfig()
    loss: PolicyLossConfig = PolicyLossConfig()
    kl: KLConfig = KLConfig()
    distill: DistillConfig = DistillConfig()  # on-policy distillation from a teacher
    rewards: RewardsConfig = RewardsConfig()
    rft: RFTConfig = RFTConfig()
    offline: OfflineConfig = OfflineConfig()  # offline RL from logged trajectories
    domains: DomainsConfig = DomainsConfig()
    difficulty: DifficultyConfig = DifficultyConfig()
    monitor: MonitorConfig = MonitorConfig()  # stability alerts
    optimizer: OptimizerConfig = OptimizerConfig()
    train: LoopConfig = LoopConfig()  # steps = RL steps
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    # LoRA adapters on the frozen `model`, which is also the KL reference (adapters off); the
    # sampler gets merged weights (docs/lora.md). None: the full policy is trained.
    lora: LoRAConfig | None = None

    def __post_init__(self):
        if self.data is None:
            raise ConfigError("data: set data.sources to at least one prompt file")
        if self.data.curriculum and (self.domains.adaptive or self.domains.grouped):
            raise ConfigError(
                "data.curriculum sets the prompt mix by step; adaptive or grouped domain weights "
                "set it too: turn domains.adaptive and domains.grouped off, or drop the curriculum"
            )
        if self.data.curriculum and self.data.num_epochs is not None:
            raise ConfigError("data.curriculum needs data.num_epochs=None (prompts repeat)")
        if self.env.name and self.rollout.partial:
            raise ConfigError("rollout.partial is for single-turn rollouts; unset env.name")
        rows = self.data.batch_size * self.rollout.num_generations
        if rows % self.algorithm.minibatches:
            raise ConfigError(
                f"{rows} rollouts per step (data.batch_size x rollout.num_generations) do not "
                f"split into algorithm.minibatches={self.algorithm.minibatches}"
            )

    @property
    def ppo(self) -> bool:
        return self.algorithm.advantage == "gae"

    @property
    def fused_old_logps(self) -> bool:
        """Whether the update's forward supplies the old log-probs (`algorithm.fuse_old_logps`
        where nothing needs them before the update: one update per batch, no critic, no
        teacher, no KL penalty in the reward, no off-policy correction) and the mode is not
        zero-mismatch: a forward inside `value_and_grad` is compiled with its backward, and XLA
        fuses it otherwise than the sampler's (in float32 one ulp on a few % of the tokens),
        while a pass of its own gives the sampler's bits."""
        a = self.algorithm
        return (
            a.fuse_old_logps and not self.model.batch_invariant
            and a.epochs == 1 and a.minibatches == 1 and not self.ppo
            and not self.distill.teacher and self.loss.correction == "off"
            and not (self.kl.enabled and self.kl.mode == "reward")
        )  # fmt: skip

    @property
    def rows(self) -> int:
        return self.data.batch_size * self.rollout.num_generations

    @property
    def updates(self) -> int:
        return self.train.steps * self.algorithm.epochs * self.algorithm.minibatches
