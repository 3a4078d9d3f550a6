"""When eager torch does not fit the value a user has: the fewest blocks whose checkpointing is predicted to bring
the step under the limit, chosen by the activations each block saved in the measured eager step, then measured as
an engine of its own (`torch-checkpoint[encoder.layers.0-5]`) before it is advised. Where the measured plan is
still over, the next block joins it and the plan is measured again, a few times at most."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from benchlib.fit.settings import THOROUGH
from benchlib.records.metrics import MODULE_METRIC, SAVED_ROLE
from benchlib.units import format_bytes, format_seconds

TRIES = 3  # plans measured before the advice stops adding blocks


@dataclass
class CheckpointAdvice:
    """The blocks to checkpoint, the total predicted for them, and the plan's measured total and time; or why
    there is no plan."""

    blocks: tuple[str, ...] = ()
    engine: str = ""
    predicted: float = math.nan
    total: float = math.nan  # the last plan measured
    seconds: float = math.nan
    fits: bool = False
    reason: str = ""
    of: int = 0  # blocks there are

    def line(self, reference: str) -> str:
        if self.reason:
            return f"  {reference} does not fit, and no checkpoint plan of its blocks was found: {self.reason}"
        return (f"  {reference} does not fit: checkpointing {len(self.blocks)} of its {self.of} blocks, {self.engine}, "
                f"is predicted at {format_bytes(int(self.predicted))} from the activations they saved; measured "
                f"{format_bytes(int(self.total))}: "
                + ("fits" if self.fits else "still over; try it joined with torch-autocast or torch-microbatch")
                + f" ({format_seconds(self.seconds)}/step)")


def saved_by_block(breakdown: Sequence[Mapping], blocks: Sequence[str]) -> dict[str, float]:
    """The activations each block saved (its own modules' and its inner modules'), from a step's module rows."""
    saved = dict.fromkeys(blocks, 0.0)
    for row in breakdown:
        if row["metric"] != MODULE_METRIC or row["params"]["role"] != SAVED_ROLE:
            continue
        path = row["params"]["module"]
        block = next((block for block in blocks if path == block or path.startswith(f"{block}.")), None)
        if block is not None:
            saved[block] += row["value"]
    return saved


def fewest_blocks(total: float, saved: Mapping[str, float], usable: float) -> tuple[list[str], float]:
    """The fewest blocks whose checkpointing is predicted to bring `total` under `usable`, largest savers first,
    and that prediction (`predicted_total`). All blocks that save anything, and their prediction, where no set is
    enough."""
    chosen: list[str] = []
    predicted = total
    for block in sorted((block for block in saved if saved[block] > 0), key=lambda block: -saved[block]):
        chosen.append(block)
        predicted = predicted_total(total, saved, chosen)
        if predicted <= usable:
            break
    return chosen, predicted


def predicted_total(total: float, saved: Mapping[str, float], chosen: Sequence[str]) -> float:
    """Eager's `total` with `chosen` checkpointed: their saved activations leave it, but for the largest, which its
    recomputation in backward holds again."""
    return total - sum(saved[block] for block in chosen) + max(saved[block] for block in chosen)


@dataclass(frozen=True)
class EagerStep:
    """Eager torch's measured step at the value: its total, and its memory by module (`module_bytes` rows)."""

    total: float
    by_module: list


def advise(model_file, values: dict, device, eager: EagerStep, usable: float, blocks: Sequence[str],
           progress: Callable[[str], None], steps: int = THOROUGH.steps) -> CheckpointAdvice:
    """The checkpoint plan for eager's step over the model's `blocks` (`checkpoint_blocks`), measured before it is
    given; where even every block is predicted over, that plan is measured too (the prediction counts a whole
    block's recomputation, which can be far more than it holds), and the line says what it measured."""
    from benchlib.engines.techniques.modules import checkpointing
    from benchlib.fit import measured

    if not blocks:
        return CheckpointAdvice(reason="the model has no stack of repeated blocks and no top-level child whose "
                                       "forward takes one tensor")
    total = eager.total
    saved = saved_by_block(eager.by_module, blocks)
    chosen, predicted = fewest_blocks(total, saved, usable)
    if not chosen:
        return CheckpointAdvice(reason="its blocks saved no activations that saved-tensor hooks could see", of=len(blocks))
    order = sorted((block for block in saved if saved[block] > 0), key=lambda block: -saved[block])
    advice = CheckpointAdvice(predicted=predicted, of=len(blocks))
    for _ in range(TRIES):
        ordered = [block for block in blocks if block in chosen]  # the model's order, so ranges read as ranges
        advice.blocks, advice.engine = tuple(ordered), checkpointing(ordered)
        outcome = measured.measure_step(model_file, advice.engine, values, device, steps=steps)
        if not outcome.measured:
            advice.reason = f"{advice.engine} {outcome.reason}"
            return advice
        advice.total, advice.seconds = outcome.total, outcome.seconds
        advice.fits = advice.total <= usable
        progress(f"{model_file.name} {advice.engine}: {format_bytes(int(advice.total))}, "
                 + ("fits" if advice.fits else "still over"))
        if advice.fits or len(chosen) == len(order):
            return advice
        chosen.append(order[len(chosen)])
        advice.predicted = predicted_total(total, saved, chosen)
    return advice
