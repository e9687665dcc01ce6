"""`dataset`: examples from rows of a local JSONL/Parquet file, a local dataset folder or a HF datasets name.

Each row gives the prompt (a string, or a list of chat messages) under `prompt_key` and the reference
answer under `answer_key`; the other columns land in `Example.info`. Rows are shuffled with the seed
each epoch and cycled forever. Rewards: `exact` (stripped completion equals the answer), `contains`
(the answer occurs in the completion), `final-number` (the last integer or \\boxed{} equals the answer).

`load_rows(source, split)` is public so external environments can read their data the same way:

    load_rows("data/train.jsonl")            # local JSON lines
    load_rows("data/train.parquet")          # local Parquet
    load_rows("path/to/saved_or_repo_dir")   # datasets.load_dataset on a local folder
    load_rows("org/name", split="test")      # a HF datasets name (needs the hub or its cache)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from prime_rl.envs.arithmetic import parse_final_answer
from prime_rl.envs.base import EnvError, Example, shuffled_forever


def load_rows(source: str, split: str = "train") -> list[dict[str, Any]]:
    """All rows of `source` as dicts (see the module docstring for what `source` may be)."""
    import datasets  # heavy; only environments that read data pay for it

    path = Path(source)
    try:
        if path.is_file():
            kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
            if kind is None:
                raise EnvError(f"dataset file {source}: expected .jsonl, .json or .parquet")
            data = datasets.load_dataset(kind, data_files=str(path), split="train")
        elif path.is_dir() and (path / "dataset_info.json").is_file():
            data = datasets.load_from_disk(str(path))
            if isinstance(data, datasets.DatasetDict):
                data = data[split]
        else:
            data = datasets.load_dataset(source, split=split)
    except EnvError:
        raise
    except Exception as e:  # datasets raises many kinds (FileNotFoundError, DatasetNotFoundError, ValueError)
        raise EnvError(f"cannot load dataset {source!r} (split {split!r}): {type(e).__name__}: {e}") from None
    rows = data.to_list()
    if not rows:
        raise EnvError(f"dataset {source!r} (split {split!r}) has no rows")
    return rows


@dataclass
class DatasetEnv:
    source: str
    split: str = "train"
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    system_prompt: str | None = None
    reward: Literal["exact", "contains", "final-number"] = "exact"

    def __post_init__(self) -> None:
        if self.reward not in ("exact", "contains", "final-number"):
            raise ValueError(f"reward must be exact, contains or final-number, got {self.reward!r}")
        self.rows = load_rows(self.source, self.split)
        missing = {self.prompt_key, self.answer_key} - set(self.rows[0])
        if missing:
            raise EnvError(f"dataset {self.source!r} lacks column(s) {sorted(missing)}; has {sorted(self.rows[0])}")

    def make_example(self, row: dict[str, Any]) -> Example:
        prompt = row[self.prompt_key]
        if isinstance(prompt, str) and self.system_prompt is not None:
            prompt = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": prompt}]
        info = {k: v for k, v in row.items() if k not in (self.prompt_key, self.answer_key)}
        return Example(prompt=prompt, answer=str(row[self.answer_key]), info=info)

    def examples(self, seed: int) -> Iterator[Example]:
        return map(self.make_example, shuffled_forever(self.rows, seed))

    def score(self, completion: str, example: Example) -> float:
        if self.reward == "exact":
            return float(completion.strip() == example.answer.strip())
        if self.reward == "contains":
            return float(example.answer.strip() in completion)
        return float(str(parse_final_answer(completion)) == example.answer.strip())


def load_environment(**args) -> DatasetEnv:
    return DatasetEnv(**args)
