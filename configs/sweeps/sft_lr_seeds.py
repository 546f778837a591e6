"""Two learning rates x two seeds on the tiny SFT config, short runs.

    posttrain sweep --config=configs/sweeps/sft_lr_seeds.py --workdir=runs/lr_seeds  # CPU, 1-2 min

Four trials of 60 steps each, run one after another; the table ranks the learning rates by the
final eval loss, mean ± std over the seeds. `--dry-run` prints the four `posttrain train`
commands instead (docs/sweeps.md).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    # Dotted keys ("train.steps") need allow_dotted_keys; nested dicts work too.
    return ml_collections.ConfigDict(
        {
            "base": "configs/sft.py:tiny",  # the config every trial starts from
            "overrides": {  # applied to every trial: short runs
                "train.steps": 60,
                "train.eval_every": 30,
                "train.log_every": 10,
                "train.progress": False,
                "checkpoint.every": 30,
                "optimizer.warmup_steps": 10,
            },
            "search": "grid",  # every combination of the grid's values
            "grid": {"optimizer.learning_rate": [3e-3, 1e-3]},  # dotted key -> values
            "seeds": (0, 1),  # each combination once per seed (train.seed and data.seed)
            "metric": "eval_loss",  # ranks the trials
            "mode": "min",  # lower is better
        },
        allow_dotted_keys=True,
    )
