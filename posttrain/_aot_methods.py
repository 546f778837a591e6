"""What `posttrain compile` builds for each method, as its driver would: the trained params'
shapes and shardings, the loss, and the loss's frozen inputs (a LoRA run's base)."""

from __future__ import annotations


def frozen_inputs(method: str, c, model_config, mesh) -> tuple:
    """Abstract traced inputs of the loss beside the state: a LoRA run's frozen base
    (quantised for QLoRA; a reward model's without its LM head)."""
    lora = c.lora
    if lora is None:
        return ()
    from posttrain.lora import quantized_shapes
    from posttrain.models import param_shapes
    from posttrain.train._lora import base_shardings
    from posttrain.train._rm import _trunk
    from posttrain.train._run import with_shardings

    shapes = param_shapes(model_config)
    if lora.quantize:
        shapes = quantized_shapes(model_config, lora.quantize, lora.quant_block)
    base = with_shardings(shapes, base_shardings(lora, model_config, mesh))
    return (_trunk(base),) if method == "rm" else (base,)


def method_loss(method: str, c, model_config, *inputs):
    """The method's loss_fn as its driver builds it (DPO: precomputed reference, except with
    LoRA, whose on-the-fly reference is the base already in the arguments)."""
    lora = c.lora
    if method == "sft":
        from posttrain.train._sft import sft_loss

        base = dict(lora=lora, base_params=inputs[0]) if lora else {}
        return sft_loss(model_config, c.z_loss, **base)
    if method == "dpo":
        from posttrain.train._dpo import dpo_loss

        reference = c.loss.resolved_reference
        if reference == "on_the_fly" and lora is None:
            reference = "precomputed"  # (the reference's bytes are counted as resident)
        return dpo_loss(
            model_config,
            loss_type=c.loss.type,
            beta=c.loss.beta,
            reference=reference,
            sft_weight=c.loss.sft_weight,
            **(dict(lora=lora, base_params=inputs[0]) if lora else {}),
        )
    if method == "rm":
        from posttrain.train._rm import reward_model_loss

        return reward_model_loss(model_config, lora=lora, base_trunk=inputs[0] if lora else None)
    from posttrain.rl._loss import CriticLoss, rl_loss

    return rl_loss(
        model_config,
        c.loss,
        max_new_tokens=c.rollout.max_new_tokens,
        use_reference=c.kl.enabled,
        kl_in_loss=c.kl.mode == "loss",
        critic=CriticLoss(model_config) if c.ppo else None,
        lora=lora,
        base_params=inputs[0] if lora else None,
    )


def trainable_shapes(method: str, c, model_config, mesh):
    """(abstract params, their shardings, decay mask) of what the method trains, from the
    drivers' own `Trainable`s (nothing is initialised): with LoRA the adapters (and a reward
    model's heads; the base is a step argument), PPO's policy beside its critic."""
    from posttrain.train._lora import lora_trainable
    from posttrain.train._rm import lora_reward_trainable, reward_trainable
    from posttrain.train._run import model_trainable

    if method == "rm":
        if c.lora is not None:
            t = lora_reward_trainable(c.lora, model_config, mesh, 0, 1)
        else:
            t = reward_trainable(c.model, model_config, mesh, 0, 1)
        return t.shapes, t.shardings, t.decay_mask
    if c.lora is not None:
        t = lora_trainable(c.lora, model_config, mesh, 0)
    else:
        t = model_trainable(c.model, model_config, mesh, 0)
    if method in ("grpo", "ppo") and c.ppo:
        value = reward_trainable(c.model, model_config, mesh, 0, 1)  # the critic
        return (
            {"policy": t.shapes, "value": value.shapes},
            {"policy": t.shardings, "value": value.shardings},
            {"policy": t.decay_mask, "value": value.decay_mask},
        )
    return t.shapes, t.shardings, t.decay_mask
