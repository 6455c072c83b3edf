"""LightningDataModule: read + validate + mix sources, encode with the chat template,
report what will be trained on, serve dynamically padded or padding-free packed batches.

With ``data.cache`` (the default) the encoded rows live in a :mod:`rolemrc.data.store` built once
(by local rank 0 in :meth:`ChatDataModule.prepare_data`, the other ranks waiting at Lightning's
barrier) and memory-mapped by every rank; ``data.cache=false`` encodes into memory at every start.
Both give the same rows, order, batches and report."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from rolemrc.config import DataConfig, as_schema, source_group
from rolemrc.data.collate import STEP_TOTALS, StepCollator, collator, row_totals
from rolemrc.data.packing import pack_rows
from rolemrc.data.readers import ReadReport, bad_records, read_examples
from rolemrc.data.sampler import (ResumableLoader, ResumableSampler, SamplerPlace, StepBatchSampler, StepItems,
                                  epoch_batches_under_limit, repeated_batches)
from rolemrc.data.store import (CHUNK, Spec, Store, encode_examples, encoded_rows_key_parts, nothing_to_train,
                                open_or_build, open_or_build_encoded_rows)
from rolemrc.data.schemas import Conversation, DataError, Pair, PromptItem, Unpaired
from rolemrc.data.templates import ChatFormat, TemplateRenderError

log = logging.getLogger(__name__)


class _Unrenderable:
    """Records the chat template cannot render: with ``on_error=raise`` one :class:`DataError`
    listing ``file:line: problem`` for each; with ``skip`` dropped and counted in the report."""

    def __init__(self, kind: str, on_error: str) -> None:
        self.kind, self.on_error = kind, on_error
        self.problems: list[str] = []

    def add(self, origin: str, err: TemplateRenderError) -> None:
        self.problems.append(f"{origin}: {err}")

    def encoded(self, examples: list[Any], chat: ChatFormat, max_length: int,
                max_prompt_length: int | None = None) -> Iterator[tuple[Any, Any]]:
        """``(example, its encoding)`` in order, each chunk of examples (the store's ``CHUNK``)
        encoded in one call as the store's build does, those the template cannot render added
        here; a progress bar on long inputs."""
        with tqdm(total=len(examples), desc=f"encode {self.kind}", leave=False, disable=len(examples) < 2000) as bar:
            for start in range(0, len(examples), CHUNK):
                chunk = examples[start:start + CHUNK]
                for ex, enc in zip(chunk, encode_examples(chat, self.kind, chunk, max_length, max_prompt_length),
                                   strict=True):
                    if isinstance(enc, TemplateRenderError):
                        self.add(ex.origin, enc)
                    else:
                        yield ex, enc
                bar.update(len(chunk))

    def done(self, rows: list[dict], report: dict, empty: list[str]) -> tuple[list[dict], dict]:
        """``(rows, report)`` with the dropped records counted in the report, once they are checked:
        ``empty`` (no trained token left) and the unrenderable ones (:func:`bad_records`)."""
        report.update(dropped_no_trainable_token=len(empty), dropped_examples=empty[:5],
                      dropped_template_error=len(self.problems), template_errors=self.problems[:5])
        bad_records(len(self.problems), f"{self.kind} record(s) the chat template cannot encode", self.problems,
                    self.on_error, log)
        return rows, report


def encode_sft(examples: list[Conversation], chat: ChatFormat, max_length: int,
               on_error: str = "raise") -> tuple[list[dict], dict]:
    """Encoded rows and the mask report; conversations left with no trained token are dropped,
    and so, with ``on_error="skip"``, are those the chat template cannot render."""
    rows: list[dict] = []
    tokens = trained = truncated = 0
    empty: list[str] = []
    bad = _Unrenderable("sft", on_error)
    for ex, enc in bad.encoded(examples, chat, max_length):
        truncated += enc.truncated
        if enc.n_predicted == 0:  # a trained token only at position 0 (never a target) trains nothing either
            empty.append(ex.origin)
            continue
        tokens += len(enc.input_ids)
        trained += enc.n_trained
        rows.append({"input_ids": enc.input_ids, "labels": enc.labels, "index": len(rows)})
    return bad.done(rows, {"examples": len(rows), "tokens": tokens, "trained_tokens": trained,
                           "trained_fraction": round(trained / max(tokens, 1), 4), "truncated": truncated}, empty)


def encode_pairs(
    examples: list[Pair], chat: ChatFormat, max_length: int, max_prompt_length: int, on_error: str = "raise"
) -> tuple[list[dict], dict]:
    rows: list[dict] = []
    prompt_tokens = response_tokens = prompt_cut = response_cut = 0
    empty: list[str] = []
    bad = _Unrenderable("pairs", on_error)
    for ex, enc in bad.encoded(examples, chat, max_length, max_prompt_length):
        prompt_cut += enc.prompt_truncated
        response_cut += enc.response_truncated
        if not enc.chosen_ids or not enc.rejected_ids:
            empty.append(ex.origin)
            continue
        prompt_tokens += len(enc.prompt_ids)
        response_tokens += len(enc.chosen_ids) + len(enc.rejected_ids)
        rows.append({"prompt_ids": enc.prompt_ids, "chosen_ids": enc.chosen_ids, "rejected_ids": enc.rejected_ids,
                     **({"margin": ex.margin} if ex.margin is not None else {}), "index": len(rows)})
    return bad.done(rows, {"examples": len(rows), "prompt_tokens": prompt_tokens, "response_tokens": response_tokens,
                           "prompt_truncated": prompt_cut, "response_truncated": response_cut}, empty)


def encode_unpaired(examples: list[Unpaired], chat: ChatFormat, max_length: int, max_prompt_length: int,
                    on_error: str = "raise") -> tuple[list[dict], dict]:
    """Encoded unpaired examples (the prompt cut from the left to ``max_prompt_length``, the
    completion from the right to fit ``max_length``, as a pair's sides are) and their report."""
    rows: list[dict] = []
    prompt_tokens = completion_tokens = prompt_cut = completion_cut = 0
    empty: list[str] = []
    bad = _Unrenderable("unpaired", on_error)
    for ex, enc in bad.encoded(examples, chat, max_length, max_prompt_length):
        prompt_cut += enc.prompt_truncated
        completion_cut += enc.response_truncated
        if not enc.chosen_ids:
            empty.append(ex.origin)
            continue
        prompt_tokens += len(enc.prompt_ids)
        completion_tokens += len(enc.chosen_ids)
        rows.append({"prompt_ids": enc.prompt_ids, "completion_ids": enc.chosen_ids, "label": bool(ex.label),
                     "index": len(rows)})
    return bad.done(rows, {"examples": len(rows), "desirable": sum(r["label"] for r in rows),
                           "undesirable": sum(not r["label"] for r in rows), "prompt_tokens": prompt_tokens,
                           "completion_tokens": completion_tokens, "prompt_truncated": prompt_cut,
                           "completion_truncated": completion_cut}, empty)


def encode_prompts(examples: list[PromptItem], chat: ChatFormat, max_prompt_length: int,
                   on_error: str = "raise") -> tuple[list[dict], dict]:
    """Prompt rows for online RL (data kind ``prompts``): each prompt rendered with the chat template
    and its generation prompt, cut from the left to ``max_prompt_length`` tokens (the end, where the
    question and the assistant header are, is kept; counted as ``prompt_truncated``), with the
    messages and reward columns (:meth:`PromptItem.columns`) the rewards read."""
    rows: list[dict] = []
    tokens = cut = 0
    bad = _Unrenderable("prompts", on_error)
    texts: list[str | None] = []
    for ex in examples:
        try:
            texts.append(chat.render(ex.prompt, add_generation_prompt=True))
        except TemplateRenderError as err:
            bad.add(ex.origin, err)
            texts.append(None)
    ids = iter(chat.tokenize_many([t for t in texts if t is not None]))
    for ex, text in zip(examples, texts, strict=True):
        if text is None:
            continue
        prompt_ids = next(ids)
        if len(prompt_ids) > max_prompt_length:
            prompt_ids = prompt_ids[-max_prompt_length:]
            cut += 1
        tokens += len(prompt_ids)
        rows.append({"prompt_ids": prompt_ids, "messages": ex.prompt, "columns": ex.columns(), "index": len(rows)})
    return bad.done(rows, {"examples": len(rows), "prompt_tokens": tokens, "prompt_truncated": cut}, [])


def item_totals(item: Any) -> tuple[int, ...]:
    """:func:`row_totals` of a row, or summed over the rows of a pack."""
    rows = item if isinstance(item, list) else [item]
    return tuple(map(sum, zip(*(row_totals(r) for r in rows))))


class ChatDataModule(L.LightningDataModule):
    """``kind="sft"`` (conversations), ``kind="pairs"`` (preference pairs) or ``kind="unpaired"``
    (``objective=kto``: the examples of ``data.unpaired``, in a store of their own as encoded in
    memory; with ``data.unpaired`` empty, the pairs of ``data.pairs``, each batch row a pair's
    chosen then rejected row as kind "pairs" serves them, the module reading the chosen rows as
    desirable) or ``kind="prompts"`` (GRPO's prompt rows, in a store of their own too).

    ``cfg.packing``: loader items are packs of rows filling up to ``cfg.max_length`` tokens
    (best-fit decreasing, fixed at setup), one pack per batch row, ``cfg.batch_size`` packs per
    batch. ``share_prompt`` (pairs): prompt, chosen and rejected in one sequence. Either way the
    batches come from :class:`PackedCollator`; the sampler indexes items (rows or packs), so
    resume works the same.
    """

    def __init__(self, cfg: DataConfig | Any, kind: str, chat: ChatFormat, seed: int = 42, report_dir: str | None = None,
                 share_prompt: bool = False, step_repeat: int = 1) -> None:
        super().__init__()
        self.step_repeat = step_repeat  # each step's micro-batches read this many times (GRPO's num_iterations)
        if kind not in ("sft", "pairs", "unpaired", "prompts"):
            raise ValueError(f"kind must be 'sft', 'pairs', 'unpaired' or 'prompts', got {kind!r}")
        self.cfg: DataConfig = as_schema(cfg, DataConfig, name="inline")
        kind = source_group(kind, self.cfg)  # unpaired without data.unpaired: the pairs, split by the module
        self.kind, self.chat, self.seed = kind, chat, seed
        self.report_dir = report_dir
        self.share_prompt = share_prompt and kind == "pairs"
        self.train_rows: Sequence[dict] | None = None  # a list, or the store's StoredRows
        self.val_rows: Sequence[dict] = []
        self.store: Store | None = None
        self.report: dict[str, Any] = {}
        self._sampler: ResumableSampler | None = None
        self._batches: StepBatchSampler | None = None
        self.place = SamplerPlace()  # the train sampler's place, saved in every checkpoint
        self._packs: dict[tuple[str, bool], list[list[dict]]] = {}

    def _encode(self, examples: list[Any]) -> tuple[list[dict], dict]:
        if self.kind == "sft":
            return encode_sft(examples, self.chat, self.cfg.max_length, self.cfg.on_error)
        if self.kind == "prompts":
            return encode_prompts(examples, self.chat, self.cfg.max_prompt_length, self.cfg.on_error)
        if self.kind == "unpaired":
            return encode_unpaired(examples, self.chat, self.cfg.max_length, self.cfg.max_prompt_length,
                                   self.cfg.on_error)
        return encode_pairs(examples, self.chat, self.cfg.max_length, self.cfg.max_prompt_length, self.cfg.on_error)

    def _open_store(self) -> Store:
        if self.store is None and self.kind in ("prompts", "unpaired"):  # the rows encoded here, stored as made
            self.store = open_or_build_encoded_rows(encoded_rows_key_parts(self.cfg, self.kind, self.seed, self.chat),
                                                    self.cfg.cache_dir, self._read_and_encode, row_totals,
                                                    len(STEP_TOTALS[self.kind]))
        if self.store is None:
            self.store = open_or_build(Spec.of(self.cfg, self.kind, self.seed), self.chat, self.cfg.cache_dir,
                                       self.cfg.num_proc)
        return self.store

    def prepare_data(self) -> None:
        """Local rank 0 builds the store (or checks the one there) while the others wait."""
        if self.cfg.cache:
            self._open_store()

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is not None:
            return
        if self.cfg.cache:  # the rows from the store (prompt rows and unpaired examples: a store of their own)
            self._setup_from_store()
        else:
            self.train_rows, self.val_rows, self.report = self._read_and_encode()
            self._log_reports()
        if self.cfg.packing:  # fixed once at build time (or here, without the cache): the report shows the fill
            self.items("train")
            self.items("val")
        if self.report_dir:
            Path(self.report_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.report_dir) / f"data_report_{self.kind}.json").write_text(json.dumps(self.report, indent=2))

    def _setup_from_store(self) -> None:
        store = self._open_store()
        self.train_rows, self.val_rows = store.rows("train"), store.rows("val")
        self.report = json.loads(json.dumps(store.report))
        self._log_reports()
        if not len(self.train_rows):
            raise DataError(nothing_to_train(self.kind, self.report["train"], self.cfg))
        if not self.report["val"] and self.cfg.val_fraction > 0 and not getattr(self.cfg, f"{self.kind}_val"):
            log.warning("data.val_fraction=%s holds out nothing: only %d %s record(s); no validation",
                        self.cfg.val_fraction, sum(self.report["sources"].values()), self.kind)

    def _log_reports(self) -> None:
        """The data report: what was read of each source, then the mask reports."""
        r = self.report
        for line in ReadReport(r["sources"], r["skipped"], r["skipped_examples"]).lines():
            log.info(line)
        train_report, val_report = r["train"], r["val"]
        log.info("mask report (train): %s", json.dumps(train_report))
        if val_report:
            log.info("mask report (val): %s", json.dumps(val_report))
        if train_report["dropped_no_trainable_token"]:
            log.warning("%d example(s) had no trainable token after truncation and are not trained on: %s",
                        train_report["dropped_no_trainable_token"], ", ".join(train_report["dropped_examples"]))

    def _read_and_encode(self) -> tuple[list[dict], list[dict], dict]:
        """(train rows, val rows, data report): the sources read and encoded in memory (what a
        prompt-rows or unpaired-rows store is built from)."""
        sources, val_sources = getattr(self.cfg, self.kind), getattr(self.cfg, f"{self.kind}_val")
        # Without validation sources, val_fraction of the records is held out before the source
        # weights duplicate or subsample the rest: no copy of a validation record is trained on.
        holdout = 0.0 if val_sources else self.cfg.val_fraction
        train, read_report = read_examples(list(sources), self.kind, self.cfg.on_error, self.seed, holdout=holdout)
        val = read_report.held_out
        if val_sources:
            val, _ = read_examples(list(val_sources), self.kind, self.cfg.on_error, self.seed)
        train_rows, train_report = self._encode(train)
        val_rows, val_report = self._encode(val) if val else ([], {})
        if not train_rows:
            raise DataError(nothing_to_train(self.kind, train_report, self.cfg))
        if holdout > 0 and not val:
            log.warning("data.val_fraction=%s holds out nothing: only %d %s record(s); no validation",
                        holdout, sum(read_report.kept.values()), self.kind)
        report = {"sources": read_report.kept, "skipped": read_report.skipped,
                  "skipped_examples": read_report.examples, "train": train_report, "val": val_report}
        return train_rows, val_rows, report

    def collator(self) -> Any:
        """Takes a list of rows (or of packs when packing) and returns the batch tensors."""
        return collator(self.kind, self.chat.tokenizer.pad_token_id, self.cfg.packing, self.share_prompt)

    def items(self, stage: str) -> Sequence[Any]:
        """What the loader of ``stage`` (train/val) indexes: rows, or packs of rows."""
        rows = self.train_rows if stage == "train" else self.val_rows
        if not self.cfg.packing or rows is None or not len(rows):
            return rows if rows is not None else []
        key = (stage, self.share_prompt)
        if key not in self._packs:
            if self.store is not None:  # the plan stored with the rows
                packs, report = self.store.packs(stage, self.share_prompt)
            else:
                packs, report = pack_rows(list(rows), self.cfg.max_length, self.share_prompt)
            self._packs[key] = packs
            log.info("packing (%s): %s", stage, json.dumps(report))
            self.report.setdefault("packing", {})[stage] = report
        return self._packs[key]

    def _rank_world(self) -> tuple[int, int]:
        if self.trainer is None:
            return 0, 1
        return self.trainer.global_rank, self.trainer.world_size

    def train_dataloader(self) -> DataLoader:
        """Micro-batches tagged with their optimizer step's global totals (label tokens, pairs):
        see :class:`~rolemrc.data.sampler.StepBatchSampler`. Resumes mid-epoch at the restored
        :class:`~rolemrc.data.sampler.SamplerPlace`."""
        assert self.train_rows is not None, "call setup() first"
        rank, world = self._rank_world()
        items = self.items("train")
        self._sampler = ResumableSampler(len(items), self.cfg.shuffle, self.seed, rank, world)
        accumulate, limit = 1, None
        if self.trainer is not None:
            self._sampler.set_epoch(self.trainer.current_epoch)
            accumulate = self.trainer.accumulate_grad_batches
            full = repeated_batches(len(self._sampler), self.cfg.batch_size, accumulate, self.step_repeat)
            limit = epoch_batches_under_limit(full, self.trainer.limit_train_batches)
        weights = self._item_weights("train", items)
        self._batches = StepBatchSampler(self._sampler, self.cfg.batch_size, accumulate, weights, limit,
                                         step_ahead=self.kind == "prompts",  # GRPO rolls out a step at once
                                         repeat=self.step_repeat)
        self.place.attach(self._batches, self._layout(), self.trainer)
        return ResumableLoader(
            StepItems(items),
            batch_sampler=self._batches,
            collate_fn=StepCollator(self.collator(), STEP_TOTALS[self.kind]),
            num_workers=self.cfg.num_workers,
            place=self.place,
        )

    def _item_weights(self, stage: str, items: Sequence[Any]) -> torch.Tensor:
        """``[n_items, K]`` float64: :func:`item_totals` of every loader item (the stored per-row
        totals, summed over each pack's rows, when the rows come from the store)."""
        if self.store is None:
            return torch.tensor([item_totals(item) for item in items], dtype=torch.float64)
        totals = self.store.totals(stage)
        if self.cfg.packing:
            packs = self._packs[(stage, self.share_prompt)]
            offsets = np.asarray(packs.offsets)
            flat = totals[np.asarray(packs.flat)]
            totals = np.add.reduceat(flat, offsets[:-1], axis=0) if len(flat) else flat
        return torch.from_numpy(np.ascontiguousarray(totals, dtype=np.float64))

    def _layout(self) -> dict[str, Any]:
        """What a saved sampler place is counted in: items (stored rows or packs), batch size,
        accumulation, ranks, and the rows themselves (the store's fingerprint; None in memory)."""
        b = self._batches
        assert b is not None and self._sampler is not None
        layout = {"items": self._sampler.n, "batch_size": b.batch_size, "accumulate": b.accumulate,
                  "world_size": self._sampler.world_size, "shuffle": self._sampler.shuffle, "seed": self._sampler.seed,
                  "rows": getattr(self.train_rows, "fingerprint", None)}
        if b.repeat > 1:  # only then: the layouts of runs without reuse stay as they were saved
            layout["repeat"] = b.repeat
        return layout

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Counts the training micro-batches as the fit loop takes them (not as the loader
        prefetches them): the sampler's place; then the module's own hook, if it has one."""
        if self.trainer is not None and self.trainer.training:
            self.place.count()
        # Lightning calls only this hook when the DataModule and the LightningModule both define
        # it: hand the batch on to the module's (KTO builds its KL rows there, on the host).
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is not None and type(module).on_before_batch_transfer is not L.LightningModule.on_before_batch_transfer:
            batch = module.on_before_batch_transfer(batch, dataloader_idx)
        return batch

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The place as older runs also saved it, under this DataModule's name
        (Lightning restores that entry where a checkpoint has one); it is saved once now, with the
        train loader's state (:class:`~rolemrc.data.sampler.ResumableLoader`)."""
        self.place.load_state_dict(state)

    def val_dataloader(self) -> DataLoader | list:
        if not len(self.val_rows):
            return []
        rank, world = self._rank_world()
        items = self.items("val")
        sampler = ResumableSampler(len(items), False, self.seed, rank, world)
        return DataLoader(items, batch_size=self.cfg.batch_size, sampler=sampler,
                          collate_fn=self.collator(), num_workers=self.cfg.num_workers)
