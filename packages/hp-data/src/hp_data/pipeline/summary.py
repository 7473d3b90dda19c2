"""What a preprocess run read and wrote, as `--json` and as the end-of-run report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hp_data.progress import human


@dataclass
class PreprocessSummary:
    """What a run read and wrote; `as_dict()` is the `--json` form."""

    outputs: dict[str, str]
    dtype: str
    workers: int
    shards: int  # the work units of this run (the --json name stays)
    resumed_shards: int  # of them, finished by an earlier run
    documents_in: int
    documents_written: int
    skipped: dict[str, Any]
    invalid_examples: list[str]
    tokens: int
    tokens_by_key: dict[str, int]
    output_bytes: int
    input_bytes: int
    seconds: float
    dedup_hash_set_bytes: int | None = None
    engine: str = "hf"  # the engine that ran: hf (tokenizers), tiktoken or sentencepiece
    probe_texts: int = 0  # texts the fast engine was checked on before the run
    verified_documents: int = 0  # and documents during it
    tokenizer: dict[str, str] | None = None  # what was named, the file used, its xxh3-128

    def as_dict(self) -> dict[str, Any]:
        seconds = max(self.seconds, 1e-9)
        return {
            **self.__dict__,
            "tokens_per_second": round(self.tokens / seconds, 1),
            "documents_per_second": round(self.documents_in / seconds, 1),
            "mb_per_second": round(self.input_bytes / seconds / 1e6, 2),
        }


def format_summary(summary: PreprocessSummary) -> str:
    """The human-readable end-of-run report."""
    data = summary.as_dict()
    skipped = summary.skipped
    invalid = ", ".join(f"{count:,} {kind}" for kind, count in skipped["invalid"].items())
    lines = [
        "wrote "
        + ", ".join(f"{p}.bin/.idx" for p in summary.outputs.values())
        + f" ({summary.dtype}, {human(summary.output_bytes, 'B')})",
        f"documents: {summary.documents_in:,} in, {summary.documents_written:,} written; "
        f"skipped {skipped['empty']:,} empty, {skipped['duplicate']:,} duplicate, "
        f"{sum(skipped['invalid'].values()):,} invalid" + (f" ({invalid})" if invalid else ""),
    ]
    lines += [f"  invalid: {example}" for example in summary.invalid_examples]
    lines.append(
        f"tokens: {summary.tokens:,}"
        + (
            " (" + ", ".join(f"{k} {v:,}" for k, v in summary.tokens_by_key.items()) + ")"
            if len(summary.tokens_by_key) > 1
            else ""
        )
    )
    if summary.dedup_hash_set_bytes is not None:
        lines.append(f"dedup hash set: {human(summary.dedup_hash_set_bytes, 'B')}")
    if summary.tokenizer:
        named = summary.tokenizer["source"]
        path = summary.tokenizer["path"]
        lines.append(
            f"tokenizer: {named}"
            + (f" = {path}" if path != named else "")
            + f" (xxh3 {summary.tokenizer['xxh3_128'][:16]})"
        )
    if summary.engine == "tiktoken":
        lines.append(
            f"engine: tiktoken, ids checked against tokenizers on {summary.probe_texts:,} "
            f"probe texts and {summary.verified_documents:,} documents"
        )
    if summary.resumed_shards:
        lines.append(f"resumed: {summary.resumed_shards} of {summary.shards} shards were done")
    lines.append(
        f"time: {summary.seconds:.2f} s with {summary.workers} worker(s): "
        f"{human(data['tokens_per_second'])} tokens/s, "
        f"{human(data['documents_per_second'])} docs/s, {data['mb_per_second']:.2f} MB/s"
    )
    return "\n".join(lines)
