"""Float8 linears, through torchao's own float8 training API (`hp-runtime[float8]`).

`apply_float8` swaps a model's `nn.Linear`s for torchao's `Float8Linear` (or, for `mxfp8`,
wraps their weights for torchao's MXFP8 matmuls) while the model is still on the meta device,
before TP and FSDP (`parallelize.py`). The parameters stay what they were (fp32 masters, the
same names and shapes), so the optimizer, checkpoints and export never see float8, and a
float8 run resumes without it and the other way round.

Which linears stay in high precision, the rule `docs/training.md` documents:
- the output head: its logits feed the loss over the whole vocabulary, where float8's
  three significant bits cost accuracy for a small share of the FLOPs (torchtitan skips it);
- a MoE router's gate: its few outputs pick the experts, and a rounding changes the route;
- a linear whose in or out features are not multiples of 16 (32 for mxfp8), which float8
  matmuls refuse (of 16 x parallel.tp under TP, where each rank multiplies a shard; a MoE
  layer's shared experts are whole on each rank);
- those whose names match a `skip` pattern.
The routed experts are not `nn.Linear`s: they stay in the compute dtype (`setup.py` says so).

On a device other than CUDA, torchao's emulation runs the same code with float8 numerics
emulated, which is what the CPU tests run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from fnmatch import fnmatchcase

from torch import nn

from hp_runtime.parallel.options import MULTIPLE, Float8

# The compute capability each recipe's matmuls need on CUDA (float8: Ada/Hopper; MX: Blackwell).
CAPABILITY = {
    "tensorwise": (8, 9),
    "rowwise": (8, 9),
    "rowwise_with_gw_hp": (8, 9),
    "mxfp8": (10, 0),
}


def import_torchao() -> None:
    """torchao, imported without the deprecation warning torch logs for each Enum it
    registers (torchao's concern, printed on every rank of every float8 run otherwise);
    ImportError where the extra is not installed."""
    import logging

    log = logging.getLogger("torch.utils._pytree")

    def registering_an_enum(record: logging.LogRecord) -> bool:
        return "is an Enum subclass" not in record.getMessage()

    log.addFilter(registering_an_enum)
    try:
        import torchao.float8  # noqa: F401
    finally:
        log.removeFilter(registering_an_enum)


def matches(name: str, pattern: str) -> bool:
    """Whether a module name matches a `skip` pattern: whole, or as its last dotted parts."""
    return fnmatchcase(name, pattern) or fnmatchcase(name, "*." + pattern)


def high_precision(model: nn.Module, float8: Float8, tp: int = 1) -> dict[str, str]:
    """{linear's name: why it stays in high precision} under the rule above, for a model
    whose linears are split over `tp` ranks."""
    from hp_runtime.model.moe import MoE, Router

    gates = {id(m.gate) for m in model.modules() if isinstance(m, Router)}
    # A MoE layer is whole on every tp rank (`tp.py`): its shared experts are not split.
    whole = {id(m) for moe in model.modules() if isinstance(moe, MoE) for m in moe.modules()}
    kept = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        multiple = MULTIPLE[float8.recipe] * (1 if id(module) in whole else tp)
        if module is getattr(model, "output", None):
            kept[name] = "the output head"
        elif id(module) in gates:
            kept[name] = "a MoE router"
        elif module.in_features % multiple or module.out_features % multiple:
            kept[name] = f"{module.in_features}x{module.out_features}, not multiples of {multiple}"
        elif any(matches(name, pattern) for pattern in float8.skip):
            kept[name] = "train.float8.skip"
    return kept


def unmatched_patterns(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """The `skip` patterns that name no linear of `model` (a typo skips nothing)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return [p for p in patterns if not any(matches(n, p) for n in names)]


def torchao_config(float8: Float8, device_type: str) -> object:
    """torchao's config for the recipe; emulated off CUDA."""
    if float8.recipe == "mxfp8":
        from torchao.prototype.moe_training.config import (
            MXFP8TrainingOpConfig,
            MXFP8TrainingRecipe,
        )

        name = "MXFP8_RCEIL" if device_type == "cuda" else "MXFP8_EMULATED_RCEIL"
        return MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe[name])
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(float8.recipe)
    power_of_2 = float8.round_scales_to_power_of_2
    return dataclasses.replace(
        config,
        emulate=device_type != "cuda",
        enable_fsdp_float8_all_gather=float8.fsdp_all_gather,
        round_scales_to_power_of_2=(
            config.round_scales_to_power_of_2 if power_of_2 is None else power_of_2
        ),
    )


def apply_float8(model: nn.Module, float8: Float8, device_type: str, tp: int = 1) -> None:
    """Convert `model`'s linears but those `high_precision` keeps."""
    kept = high_precision(model, float8, tp)

    def convert(module: nn.Module, name: str) -> bool:
        return isinstance(module, nn.Linear) and name not in kept

    config = torchao_config(float8, device_type)
    if float8.recipe == "mxfp8":
        from torchao.quantization import quantize_

        quantize_(model, config, filter_fn=convert)  # type: ignore[arg-type]
    else:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=config, module_filter_fn=convert)  # type: ignore[arg-type]


def is_float8(module: nn.Module) -> bool:
    """Whether `module` is one `apply_float8` converted (either kind)."""
    from torchao.float8.float8_linear import Float8Linear

    if isinstance(module, Float8Linear):
        return True
    weight = getattr(module, "weight", None)
    return type(weight).__name__ == "MXFP8TrainingWeightWrapperTensor" or (
        type(getattr(weight, "_local_tensor", None)).__name__ == "MXFP8TrainingWeightWrapperTensor"
    )


def precompute_scales(modules: Iterable[nn.Module]) -> None:
    """After each optimizer step under `fsdp_all_gather`: every converted weight's scale for
    the next all-gather, from its new values, in one all-reduce (torchao's
    `precompute_float8_dynamic_scale_for_fsdp`); without it each weight's all-gather first
    all-reduces its own amax."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for module in modules:
        precompute_float8_dynamic_scale_for_fsdp(module)
