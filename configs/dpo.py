"""Preference alignment: DPO and its variants (IPO, hinge, robust, SPPO, NCA, SimPO, ORPO).

    make demo                                                # writes runs/demo/{sft,preferences_*}
    posttrain train --config=configs/dpo.py:tiny --workdir=/tmp/dpo_tiny   # CPU, ~1 minute

Presets:
  tiny           the demo's stage 2: the SFT model of `make demo` (runs/demo/sft) on pairs of its
                 own answers to training problems, right vs wrong (runs/demo/preferences_*.jsonl).
  iterative      iterative (online) DPO, two rounds from the demo's SFT model: each round samples
                 4 answers to 2048 new training problems from its starting policy, pairs a right
                 with a wrong one (the verifier), and trains DPO on them from that policy
                 (method "iterative_dpo"; rounds in <workdir>/round_<r>; CPU, ~1 minute).
  llama3_8b_v5p  Llama 3.1 8B (an SFT checkpoint or HF directory) on a v5p-64 slice.
Every field of configs/sft.py applies (model, data, optimizer, train, checkpoint, mesh), plus
`loss`. Override any field: --config.loss.type=ipo --config.loss.beta=0.5
Preference records: {"prompt": str or messages, "chosen": ..., "rejected": ..., "domain": ...}.
"""

import os

import ml_collections

from posttrain.config import load_config_file

_HERE = os.path.dirname(os.path.abspath(__file__))


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    presets = {"tiny": "tiny", "iterative": "tiny", "llama3_8b_v5p": "llama3_8b_v5p"}
    if preset not in presets:
        raise ValueError(f"unknown dpo preset {preset!r}: {', '.join(presets)}")
    c = load_config_file(os.path.join(_HERE, "sft.py") + ":" + presets[preset])
    c.method = "dpo"
    del c["z_loss"]
    del c["eval_suite"]  # the SFT driver's periodic eval suite
    c.data.packing = False  # one pair (chosen + rejected rows) per batch row
    c.data.on_error = "skip"  # chosen == rejected, empty responses, missing fields: counted

    c.loss = ml_collections.ConfigDict()
    c.loss.type = "sigmoid"  # sigmoid | ipo | hinge | robust | sppo_hard | nca_pair | simpo | orpo
    c.loss.beta = 0.1  # implicit-reward temperature (IPO's tau, SimPO's beta)
    c.loss.label_smoothing = 0.0  # cDPO / robust: assumed label noise
    c.loss.gamma = 0.0  # SimPO target margin
    c.loss.sft_weight = 0.0  # add this x the chosen responses' NLL (RPO)
    c.loss.reference = "auto"  # auto (precomputed; none for simpo/orpo) | on_the_fly | precomputed

    if preset in ("tiny", "iterative"):
        runs = os.path.join("runs", "demo")
        prompts = c.data.sources  # (the demo's training problems: prompts the verifier checks)
        c.model.checkpoint = os.path.join(runs, "sft")
        c.data.sources = [
            {
                "path": os.path.join(runs, "preferences_train.jsonl"),
                "weight": 1.0,
                "domain": "arithmetic",
                "format": "auto",
            }
        ]
        c.eval_data = [{**c.data.sources[0], "path": os.path.join(runs, "preferences_eval.jsonl")}]
        c.data.max_len = 48
        c.data.batch_size = 32
        c.optimizer.learning_rate = 3e-5
        c.optimizer.warmup_steps = 10
        c.optimizer.schedule = "constant"
        c.optimizer.weight_decay = 0.0
        c.loss.beta = 0.1
        # RPO: with the chosen answers' NLL added, DPO lifts held-out exact match (67% -> ~76%);
        # plain DPO (sft_weight=0) pushes down both responses' likelihood on this tiny model
        # and greedy exact match falls (to ~20%), though its preference accuracy rises.
        c.loss.sft_weight = 1.0
        c.train.steps = 300
        c.train.log_every = 10
        c.train.eval_every = 100
        c.checkpoint.every = 100
    if preset == "iterative":
        c.method = "iterative_dpo"
        c.data.sources = prompts  # prompt records; each round writes its pairs.jsonl
        c.eval_data = []  # (held-out pairs would come from one policy; rounds.json has scores)
        # Two epochs of each round's ~1000 pairs: longer rounds overfit this tiny model (300
        # steps of 1024 prompts: 67% -> 72% -> 70% held-out exact match; 60 of 2048: 67% ->
        # 76% -> 78%, and 77% -> 78% with other seeds).
        c.train.steps = 60  # per round
        c.train.eval_every = 0
        c.checkpoint.every = 60
        c.pairs = ml_collections.ConfigDict()
        c.pairs.rounds = 2
        c.pairs.limit = 2048  # prompts per round; round r takes prompts [r * 2048, ...)
        c.pairs.offset = 0
        c.pairs.samples = 4  # answers per prompt
        c.pairs.max_new_tokens = 8
        c.pairs.max_prompt_len = 64
        c.pairs.sampling = ml_collections.ConfigDict()  # how each answer's tokens are drawn
        c.pairs.sampling.temperature = 1.0  # 0 is greedy; > 0 samples softmax(logits / T)
        c.pairs.sampling.top_p = 1.0  # nucleus mass kept, in (0, 1]
        c.pairs.sampling.top_k = 0  # keep the k likeliest tokens; 0 keeps all
        c.pairs.seed = 1
        c.pairs.chunk = 64
        c.pairs.min_margin = 0.0
        c.pairs.per_prompt = 1
        c.pairs.rewards = ml_collections.ConfigDict()
        c.pairs.rewards.domains = {}  # {} : the built-in verifiers (arithmetic here)
        c.pairs.rewards.workers = 2
        c.pairs.rewards.timeout_s = 10.0
        c.pairs.rewards.pass_threshold = 1.0
    elif preset == "llama3_8b_v5p":
        c.data.sources = [
            {"path": "preferences.jsonl", "weight": 1.0, "domain": "default", "format": "auto"}
        ]
        c.eval_data = []
        c.data.max_len = 4096
        c.data.batch_size = 64
        c.optimizer.learning_rate = 5e-7
        c.optimizer.warmup_steps = 50
        c.optimizer.schedule = "linear"
        c.train.steps = 2000
    return c
