"""EAGLE-3 draft training on one data-parallel rank, without Ray: the plain class the Ray
Train worker (actors.trainer) delegates to.

Owns: building the draft with speculators (Eagle3DraftModel.from_training_args, a Llama
decoder config derived from the target, d2t/t2d from loss-masked token frequencies, frozen
embed_tokens / lm_head / final norm read from the target, including multimodal wrappers),
the step (micro-batches, speculators' TTT loss and per-step accuracies, metrics reduced
across ranks), the accuracy on the held-out split (`evaluate_heldout`, every
cfg.eval_every_steps), and checkpoint contents (DeepSpeed's save/load_checkpoint plus a client state
with every rank's data position and RNG states).
Does not own: DeepSpeed configuration (eagle3.train.deepspeed_backend hands over a ready engine),
process launch (actors.trainer), the training input (eagle3.train.data: rows, packing, prefetching,
staging on the device), the export format (eagle3.train.export).

Usage on each rank:
    trainer = Eagle3Trainer(cfg, target_dir, data_files, rank=r, world_size=w)
    trainer.attach_engine(deepspeed_backend.initialize(trainer.model, cfg, w))
    trainer.load_checkpoint(ckpt_dir)        # optional resume
    trainer.fit(checkpoint_dir=...)          # or train_step() in your own loop
    trainer.export(out_dir)                  # every rank (a collective under ZeRO-3)
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.profiler import record_function

from eagle3.train.data.pipeline import input_pipeline
from eagle3.train.data.rows import HiddenStatesDataset
from eagle3.train.data.staging import DeviceBatches
from eagle3.train.data.vocab import draft_vocab_mapping_from_counts
from eagle3.train.rounds import strict_rounds
from eagle3.train.config import FLEX_ATTN_MAX_TOKENS, TrainConfig, resolve_draft_attn_impl, resolve_draft_vocab_size

logger = logging.getLogger(__name__)


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _all_gather_object(obj, world_size: int) -> list:
    dist = _dist()
    if dist is None or world_size == 1:
        return [obj]
    out = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def first_of_each_run(mask, n: int):
    """`mask` (bool, [..., T]) kept only at the first n positions of each run of True (one run: the
    loss-masked tokens of one assistant turn, in target coordinates): the positions a vLLM answer of
    at most n tokens would be scored on."""
    counts = mask.long().cumsum(-1)
    # counts at the last False before each position (0 before any): positions into the current run
    at_false = torch.where(mask, torch.zeros_like(counts), counts)
    into_run = counts - torch.cummax(at_false, dim=-1).values
    return mask & (into_run <= n)


def _data_range(before: dict, after: dict) -> tuple[int, int, int]:
    """(epoch, first, end) positions of the samples in the micro-batch taken between two data
    states (eagle3.train.data.packing.PackedBatches: a batch never straddles epochs)."""
    if after["epoch"] == before["epoch"]:
        return after["epoch"], before["samples_seen"], after["samples_seen"]
    return after["epoch"], 0, after["samples_seen"]


def resume_refusal(path, saved_world_size: int | None, world_size: int, saved_threshold: int,
                   heldout_threshold: int) -> str | None:
    """Why the checkpoint at `path`, written by saved_world_size ranks under held-out threshold
    saved_threshold, cannot resume a run of world_size ranks and heldout_threshold; None if it can.
    The workers ask it of the checkpoint they load; the driver asks it first of what Ray Train
    registered with the checkpoint (actors.trainer.resume_refusal_before_workers), so that a refused
    resume starts no worker group."""
    if saved_world_size != world_size:
        return (f"checkpoint {path} was written by {saved_world_size} ranks, this run has {world_size}: data "
                f"positions are per rank; resume with train.num_workers={saved_world_size}")
    if saved_threshold != heldout_threshold:
        return (f"checkpoint {path} was trained with held-out threshold {saved_threshold}, this run has "
                f"{heldout_threshold} (prepared/heldout.json): data positions count the rows outside the split, "
                "so they would point at other samples; resume with the prepare output the checkpoint was "
                "trained on, or start a fresh run")
    return None


class Eagle3Trainer:
    """One rank's draft, data stream and step counter."""

    def __init__(self, cfg: TrainConfig, target_dir: str | Path,
                 data_files: str | Path | Sequence[str | Path] | None, *, rank: int = 0, world_size: int = 1,
                 dataset=None, heldout_threshold: int = 0):
        """`data_files`: committed shards (offline); or None with `dataset`, a rank's rows from
        elsewhere (online: eagle3.train.data.online.OnlineDataset), ordered and resumed the same way.
        `heldout_threshold` (prepared/heldout.json, eagle3.prepare.heldout; 0: no split): the held-out
        conversations are left out of training (by the dataset built here, or by the online dataset
        given, built with the same threshold) and measured every cfg.eval_every_steps, from the shards
        (offline) or from the online dataset's `heldout_files()` (the feed extracts them apart:
        ray_jobs/online.py), read at the first evaluation."""
        from speculators.models.eagle3.core import Eagle3DraftModel

        from compat.speculators_verifier import draft_layer_config, ensure_text_verifier_weights, verifier_text_config

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.target_dir = str(Path(target_dir).resolve())
        if (dataset is None) == (data_files is None):
            raise ValueError("Eagle3Trainer takes either data_files (shards) or dataset (online), not both or neither")
        self.dataset = dataset or HiddenStatesDataset(data_files, seed=cfg.seed, rank=rank, world_size=world_size,
                                                      shuffle_buffer_size=cfg.data.shuffle_buffer_size,
                                                      heldout_threshold=heldout_threshold)
        self.heldout_threshold = heldout_threshold
        self.heldout_dataset = None
        self._heldout_source: Callable[[], list[str]] | None = None
        if heldout_threshold and dataset is not None:
            if not hasattr(dataset, "heldout_files"):
                raise ValueError(f"a held-out split needs shards: {type(dataset).__name__} gives none "
                                 "(heldout_files); pass heldout_threshold=0")
            self._heldout_source = dataset.heldout_files
        elif heldout_threshold:
            self.heldout_dataset = self._heldout_split(data_files)
        text_cfg = verifier_text_config(self.target_dir)
        if text_cfg.hidden_size != self.dataset.hidden_size:
            raise ValueError(f"hidden states have hidden_size={self.dataset.hidden_size}, the target at "
                             f"{self.target_dir} has {text_cfg.hidden_size}: train against the target they "
                             "were extracted from")
        if self.dataset.layer_ids[-1] != text_cfg.num_hidden_layers:
            raise ValueError(f"the shards' last layer id is {self.dataset.layer_ids[-1]}, the target has "
                             f"num_hidden_layers={text_cfg.num_hidden_layers}: the last captured layer must be "
                             "the target's final layer; re-extract against this target")
        self.target_vocab_size = int(text_cfg.vocab_size)
        self.draft_vocab_size = resolve_draft_vocab_size(cfg.draft.draft_vocab_size, self.target_vocab_size)
        # Offline from the shards, online from the prepared tokens: the same counts for the same data.
        d2t, t2d = draft_vocab_mapping_from_counts(lambda: self.dataset.token_frequencies(self.target_vocab_size),
                                                   self.draft_vocab_size, self.target_vocab_size)
        torch.manual_seed(cfg.seed)  # same initial draft on every rank
        attn = resolve_draft_attn_impl(cfg.draft.draft_attn_impl, cfg.data.micro_batch_tokens, torch.cuda.is_available())
        if attn == "simple_flex_attention" and cfg.data.micro_batch_tokens > FLEX_ATTN_MAX_TOKENS:
            logger.warning("train.draft.draft_attn_impl=simple_flex_attention with train.data.micro_batch_tokens=%d: "
                           "flex attention's first-step compile was not seen to end past %d tokens "
                           "(eagle3.train.config.FLEX_ATTN_MAX_TOKENS); sdpa trained up to 49,152",
                           cfg.data.micro_batch_tokens, FLEX_ATTN_MAX_TOKENS)
        self.model = Eagle3DraftModel.from_training_args(
            draft_layer_config(self.target_dir, cfg.draft.num_draft_layers),
            t2d=t2d, d2t=d2t,
            verifier_name_or_path=self.target_dir,
            target_layer_ids=self.dataset.aux_layer_ids,
            draft_vocab_size=self.draft_vocab_size,
            norm_before_residual=True,
            norm_before_fc=cfg.draft.norm_before_fc,
            norm_output=cfg.draft.norm_output,
            ttt_steps=cfg.draft.ttt_steps,
            draft_attn_impl=attn,
        )
        ensure_text_verifier_weights(self.model, self.target_dir)
        self.engine = None
        self.batches: DeviceBatches | None = None
        self.global_step = 0
        self.tokens_seen = 0
        self.loss_first: float | None = None
        self.loss_last: float | None = None
        self.resumed_from_step: int | None = None
        self.run_tokens = 0
        self.run_seconds = 0.0
        # The first step of this run apart: on CUDA it compiles the draft's forward (speculators
        # wraps it in torch.compile), most of a short run's training time.
        self.first_step_seconds: float | None = None
        self.first_step_tokens = 0
        self.last_heldout: dict | None = None
        self._train_acc_since_eval: list[list[float]] = []
        self._full_head: tuple | None = None  # _full_vocab_head's, loaded at the last held-out evaluation

    # -- setup -----------------------------------------------------------------------------
    def attach_engine(self, engine) -> None:
        """Take the engine deepspeed_backend.initialize built around self.model."""
        from speculators.losses import resolve_loss_config

        self.engine = engine
        self.device = engine.device if isinstance(engine.device, torch.device) else torch.device(engine.device)
        dtype = next(p.dtype for p in engine.module.parameters() if p.is_floating_point())
        from compat.speculators_loss import loss_implementation

        self.loss_config = resolve_loss_config(self.cfg.draft.loss, loss_implementation())
        self.batches, how = input_pipeline(self.dataset, self.cfg.data, dtype, self.device)
        logger.info("rank %d: batches %s", self.rank, how)

    def _need_engine(self):
        if self.engine is None:
            raise RuntimeError("no engine: call attach_engine(deepspeed_backend.initialize(trainer.model, cfg, "
                               "world_size)) first")

    # -- training --------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step (gradient_accumulation_steps micro-batches); metrics averaged over
        all ranks: loss (sum over TTT steps), loss_i, full_acc_i, cond_acc_i per TTT step i,
        tokens (packed, all ranks), loss_tokens (loss-masked), lr (used by this step); and this
        rank's own: input_wait_s, how long the step waited for its batches (near 0 when reading
        keeps ahead of the device; the step time when the input is the bound), and data_ranges,
        (epoch, first, end) positions in its epoch order of each micro-batch's samples."""
        self._need_engine()
        lr = float(self.engine.get_lr()[0])
        # Loss and metrics are summed on the device and copied to the host once per step: a copy
        # per value would wait for the device each time, and the host could not queue ahead.
        sums: dict[str, torch.Tensor] = {}
        tokens = loss_tokens = 0
        input_wait = 0.0
        gas = self.cfg.data.gradient_accumulation_steps
        ranges = []
        for _ in range(gas):
            before = self.batches.state_dict()
            with record_function("eagle3.next_batch"):
                batch, inputs, wait = next(self.batches)
            ranges.append(_data_range(before, self.batches.state_dict()))
            with record_function("eagle3.forward"):
                _, loss, metrics = self.engine(**inputs, ttt_steps=self.cfg.draft.ttt_steps,
                                               ttt_step_loss_decay=self.cfg.draft.ttt_step_loss_decay,
                                               loss_config=self.loss_config)
            # the forward is queued: the next batch's copy runs under it and the backward
            with record_function("eagle3.stage_batch"):
                input_wait += wait + self.batches.stage()
            with record_function("eagle3.backward"):
                self.engine.backward(loss)
            with record_function("eagle3.optimizer_step"):
                self.engine.step()
            for k, v in (("_loss", loss), *metrics.items()):
                sums[k] = sums.get(k, 0) + v.detach().double()
            tokens += int((batch["document_ids"] >= 0).sum())
            loss_tokens += int(batch["loss_mask"].sum())
        keys = sorted(k for k in sums if k != "_loss")
        with record_function("eagle3.metrics_to_host"):  # waits for the step's kernels
            summed = torch.stack([sums[k].reshape(()) for k in ["_loss", *keys]]).cpu()
        vec = torch.cat([summed[:1], torch.tensor([gas, tokens, loss_tokens], dtype=torch.float64), summed[1:]])
        dist = _dist()
        if dist is not None and self.world_size > 1:
            vec = vec.to(self.device) if dist.get_backend() == "nccl" else vec
            dist.all_reduce(vec)
            vec = vec.cpu()
        vals = dict(zip(["_loss", "_micro", "_tokens", "_loss_tokens"] + keys, vec.tolist(), strict=True))
        self.global_step += 1
        self.tokens_seen += int(vals["_tokens"])
        self.run_tokens += int(vals["_tokens"])
        out = {"step": self.global_step, "loss": vals["_loss"] / vals["_micro"], "lr": lr,
               "tokens": int(vals["_tokens"]), "loss_tokens": int(vals["_loss_tokens"]),
               "input_wait_s": input_wait, "data_ranges": ranges}
        for i in range(self.cfg.draft.ttt_steps):
            out[f"loss_{i}"] = vals[f"loss_{i}_sum"] / max(vals[f"loss_{i}_total"], 1.0)
            for acc in ("full_acc", "cond_acc"):
                total = vals[f"{acc}_{i}_total"]
                out[f"{acc}_{i}"] = vals[f"{acc}_{i}_sum"] / total if total > 0 else 0.0
        if self.loss_first is None:
            self.loss_first = out["loss"]
        self.loss_last = out["loss"]
        return out

    def _heldout_split(self, files) -> HiddenStatesDataset | None:
        """The held-out rows of `files`: every rank the same rows in the same order (one rank's view of
        all shards, no shuffle), the evaluation's batches divided among the ranks (evaluate_heldout)."""
        if not files:
            logger.warning("the held-out split has no shard: no held-out accuracy")
            return None
        split = HiddenStatesDataset(files, seed=self.cfg.seed, shuffle_buffer_size=1,
                                    heldout_threshold=self.heldout_threshold, heldout=True)
        if split.num_samples == 0:
            logger.warning("the held-out split has no sample in the shards (extraction rejected them all?): "
                           "no held-out accuracy")
            return None
        return split

    @property
    def has_heldout(self) -> bool:
        return self.heldout_dataset is not None or self._heldout_source is not None

    def heldout_due(self) -> bool:
        """After the step just taken: every eval_every_steps steps, and after the last one."""
        return self.has_heldout and (
            self.global_step % self.cfg.eval_every_steps == 0 or self.global_step >= self.cfg.num_steps)

    def evaluate_heldout(self) -> dict | None:
        """The draft's accuracy on the held-out split, without gradients: the first micro-batches
        of its samples (fixed order) up to cfg.eval_max_tokens packed tokens, batch b evaluated by
        rank b % world_size, sums all-reduced. Returns heldout_full_acc_i, heldout_cond_acc_i,
        heldout_loss_i per TTT step i (as train_step's, over all the batches), heldout_positions
        (loss-masked positions of step 0), heldout_samples, heldout_eval_s; None without a split.
        Also the same predictions counted as vLLM counts them (eagle3.train.rounds.strict_rounds: the
        target's argmax over its whole vocabulary, each answer walked in rounds of ttt_steps
        tokens): heldout_rounds_acc_i (rounds whose first i+1 tokens were all accepted, per round),
        heldout_rounds_al, heldout_rounds, at the last evaluation; vLLM's rounds start where the
        draft just failed, so these fall below the every-position heldout_full_acc_i where the
        draft's accuracy varies along the text (not under ZeRO-3: _full_vocab_head).
        Collective: every rank calls it at the same step, and every rank runs the same number of
        forwards (a rank short of batches re-runs one uncounted), since under ZeRO-3 a forward
        gathers parameters from all ranks."""
        self._need_engine()
        if self._heldout_source is not None:  # online: the split's shards, once the feed has them
            self.heldout_dataset = self._heldout_split(self._heldout_source())
            self._heldout_source = None
        if self.heldout_dataset is None:
            return None
        from eagle3.train.data.packing import PackedBatches
        from eagle3.train.data.staging import device_inputs

        t0 = time.perf_counter()
        dtype = next(p.dtype for p in self.engine.module.parameters() if p.is_floating_point())
        ttt = self.cfg.draft.ttt_steps
        names = [f"{m}_{i}_{part}" for m in ("full_acc", "cond_acc", "loss") for i in range(ttt)
                 for part in ("sum", "total")]
        first = self.cfg.heldout_first_tokens or 0  # also over the first `first` tokens of each turn
        first_names = [f"full_acc_{i}_{part}" for i in range(ttt) for part in ("sum", "total")] if first else []
        # (lm_head, draft-to-target ids) for the rounds, at the last evaluation only: one product with
        # the whole vocabulary per batch, seconds on a CPU
        head = self._full_vocab_head() if self.global_step >= self.cfg.num_steps else None
        num_means = len(names) + len(first_names)
        sums = torch.zeros(num_means + 1 + (1 + ttt if head else 0), dtype=torch.float64)

        def forward(rows: list, batches: PackedBatches, counted: bool) -> None:
            inputs = device_inputs(batches.pack(rows), self.device, dtype)
            kw = {"ttt_steps": ttt, "ttt_step_loss_decay": self.cfg.draft.ttt_step_loss_decay,
                  "loss_config": self.loss_config}
            draft_tokens, _, metrics = self.engine(**inputs, **kw)
            got = [metrics[n] for n in names]
            if head and counted:
                counts = {"correct": [0] * ttt, "total": [0] * ttt, "oov": 0, "rounds": 0, "accepted": [0] * ttt}
                strict_rounds(self.engine.module, inputs, draft_tokens, *head, ttt, counts)
                sums[num_means + 1:] += torch.tensor([counts["rounds"], *counts["accepted"]], dtype=torch.float64)
            if first:
                inputs["loss_mask"] = first_of_each_run(inputs["loss_mask"], first)
                _, _, metrics = self.engine(**inputs, **kw)
                got += [metrics[n] for n in first_names]
            if counted:
                sums[:num_means] += torch.stack([m.detach().double().reshape(()) for m in got]).cpu()
                sums[num_means] += len(rows)

        was_training = self.engine.module.training
        self.engine.module.eval()
        try:
            with torch.no_grad():
                # Each batch is evaluated as it is read, so a rank holds one batch's rows at a time
                # (Parquet shards decode into memory).
                batches = PackedBatches(self.heldout_dataset, self.cfg.data.micro_batch_tokens, dtype)
                num_batches = num_mine = packed_tokens = 0
                while packed_tokens < self.cfg.eval_max_tokens:
                    rows = batches.take()
                    if batches.epoch > 0:  # take() went on to the next pass: every held-out sample is in
                        break
                    if num_batches % self.world_size == self.rank:
                        forward(rows, batches, counted=True)
                        num_mine += 1
                    num_batches += 1
                    packed_tokens += sum(max(len(r[0]) - 1, 0) for r in rows)
                if num_mine < -(-num_batches // self.world_size):  # a rank short of a batch: an uncounted forward
                    again = PackedBatches(self.heldout_dataset, self.cfg.data.micro_batch_tokens, dtype)
                    forward(again.take(), again, counted=False)
        finally:
            self.engine.module.train(was_training)
        dist = _dist()
        if dist is not None and self.world_size > 1:
            sums = sums.to(self.device) if dist.get_backend() == "nccl" else sums
            dist.all_reduce(sums)
            sums = sums.cpu()
        vals = dict(zip(names + ["first_" + n for n in first_names] + ["_samples"]
                        + (["_rounds"] + [f"_accepted_{i}" for i in range(ttt)] if head else []),
                        sums.tolist(), strict=True))
        out: dict = {}
        for i in range(ttt):
            for m in ("full_acc", "cond_acc", "loss") + (("first_full_acc",) if first else ()):
                total = vals[f"{m}_{i}_total"]
                out[f"heldout_{m}_{i}"] = vals[f"{m}_{i}_sum"] / total if total > 0 else 0.0
        if first:
            out["heldout_first_tokens"] = first
            out["heldout_first_positions"] = int(vals["first_full_acc_0_total"])
        if head and vals["_rounds"] > 0:
            rates = [vals[f"_accepted_{i}"] / vals["_rounds"] for i in range(ttt)]
            out.update({f"heldout_rounds_acc_{i}": r for i, r in enumerate(rates)})
            out.update(heldout_rounds=int(vals["_rounds"]), heldout_rounds_al=1.0 + sum(rates))
        out.update(heldout_positions=int(vals["full_acc_0_total"]), heldout_samples=int(vals["_samples"]),
                   heldout_eval_s=time.perf_counter() - t0)
        return out

    def _full_vocab_head(self) -> tuple | None:
        """The target's lm_head over its whole vocabulary on this rank's device, and the draft's
        target ids (compat.speculators_verifier.draft_to_target_ids), for the held-out rounds
        (eagle3.train.rounds.strict_rounds); loaded at the last evaluation. None under ZeRO-3, whose
        partitioned verifier norm is not whole outside the engine's forward."""
        if self.cfg.optimizer.zero_stage == 3:
            return None
        if self._full_head is None:
            from compat.speculators_verifier import draft_to_target_ids, full_lm_head, read_text_model_tensors

            lm_head = full_lm_head(read_text_model_tensors(self.target_dir))
            self._full_head = (lm_head.to(self.device), draft_to_target_ids(self.engine.module))
        return self._full_head

    def _heldout_record(self, step_metrics: dict) -> dict:
        """The summary's view of the last evaluation: held-out accuracy per TTT position beside the
        training accuracy averaged over the steps since the evaluation before (one step's training
        accuracy is one micro-batch's, too noisy to compare)."""
        ttt = self.cfg.draft.ttt_steps
        window = self._train_acc_since_eval
        self._train_acc_since_eval = []
        return {"step": self.global_step,
                "full_acc": [step_metrics[f"heldout_full_acc_{i}"] for i in range(ttt)],
                "cond_acc": [step_metrics[f"heldout_cond_acc_{i}"] for i in range(ttt)],
                "train_full_acc": [sum(w[i] for w in window) / len(window) for i in range(ttt)] if window else None,
                "train_steps_averaged": len(window),
                "num_positions": step_metrics["heldout_positions"], "num_samples": step_metrics["heldout_samples"],
                **({"rounds_acc": [step_metrics[f"heldout_rounds_acc_{i}"] for i in range(ttt)],
                    "rounds_al": step_metrics["heldout_rounds_al"], "num_rounds": step_metrics["heldout_rounds"]}
                   if "heldout_rounds_al" in step_metrics else {}),
                **({"first_tokens": step_metrics["heldout_first_tokens"],
                    "first_full_acc": [step_metrics[f"heldout_first_full_acc_{i}"] for i in range(ttt)],
                    "first_num_positions": step_metrics["heldout_first_positions"]}
                   if "heldout_first_tokens" in step_metrics else {})}

    def checkpoint_due(self) -> bool:
        """After the step just taken: every checkpoint_every steps, and after the last one."""
        return self.global_step % self.cfg.checkpoint.checkpoint_every == 0 or self.global_step >= self.cfg.num_steps

    def fit(self, *, checkpoint_dir: str | Path | None = None,
            on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Train until cfg.num_steps; measure the held-out split when due (its heldout_* metrics join
        the step's), checkpoint into checkpoint_dir when due (if given), then call on_step(metrics).
        Returns this call's metrics per step."""
        self._need_engine()
        history = []
        t0 = time.perf_counter()
        start = self.global_step
        while self.global_step < self.cfg.num_steps:
            t_step = time.perf_counter()
            m = self.train_step()
            if self.has_heldout:
                self._train_acc_since_eval.append([m[f"full_acc_{i}"] for i in range(self.cfg.draft.ttt_steps)])
            if self.heldout_due() and (held := self.evaluate_heldout()) is not None:
                m.update(held)
                self.last_heldout = self._heldout_record(m)
            history.append(m)
            if self.global_step == start + 1:
                step_s = time.perf_counter() - t_step
                if self.first_step_seconds is None:
                    self.first_step_seconds, self.first_step_tokens = step_s, m["tokens"]
                logger.info("rank %d step %d: loss %.4f (first step of this run, %.1f s)", self.rank, m["step"],
                            m["loss"], step_s)
            if checkpoint_dir is not None and self.checkpoint_due():
                self.save_checkpoint(checkpoint_dir)
            if on_step is not None:
                on_step(m)
        self.run_seconds += time.perf_counter() - t0
        if history:
            steady = self.steady_tokens_per_s
            logger.info("rank %d step %d: loss %.4f (loss at step %d: %.4f), %.0f tokens/s; after the first step "
                        "(%.1f s): %s", self.rank, self.global_step, history[-1]["loss"], history[0]["step"],
                        history[0]["loss"], self.tokens_per_s, self.first_step_seconds or 0.0,
                        "-" if steady is None else f"{steady:.0f} tokens/s")
        return history

    @property
    def tokens_per_s(self) -> float:
        """Tokens of this run over its wall time in fit: the first step (compile on CUDA),
        held-out evaluations, checkpoints and the on_step callbacks included."""
        return self.run_tokens / self.run_seconds if self.run_seconds > 0 else 0.0

    @property
    def steady_tokens_per_s(self) -> float | None:
        """tokens_per_s without the first step of this run (its tokens and its seconds); None
        before a second step."""
        if self.first_step_seconds is None or self.run_tokens <= self.first_step_tokens:
            return None
        seconds = self.run_seconds - self.first_step_seconds
        return (self.run_tokens - self.first_step_tokens) / seconds if seconds > 0 else None

    # -- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, checkpoint_dir: str | Path) -> str:
        """DeepSpeed checkpoint (weights, optimizer, scheduler) tagged step_NNNNNNNN under
        checkpoint_dir, with every rank's data position and RNG states in its client state.
        Every rank must call it. Returns the tag's directory."""
        self._need_engine()
        client_state = {
            "global_step": self.global_step,
            "tokens_seen": self.tokens_seen,
            "loss_first": self.loss_first,
            "loss_last": self.loss_last,
            "world_size": self.world_size,
            "heldout_threshold": self.heldout_threshold,
            "data_states": _all_gather_object(self.batches.state_dict(), self.world_size),
            "rng_states": _all_gather_object(_rng_state(), self.world_size),
        }
        tag = f"step_{self.global_step:08d}"
        self.engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state=client_state)
        return str(Path(checkpoint_dir) / tag)

    def load_checkpoint(self, checkpoint_dir: str | Path, tag: str | None = None) -> int:
        """Resume from checkpoint_dir (tag None: the one its `latest` file names); returns the step."""
        self._need_engine()
        path, client_state = self.engine.load_checkpoint(str(checkpoint_dir), tag=tag)
        if path is None:
            raise ValueError(f"no DeepSpeed checkpoint found in {checkpoint_dir} (tag={tag!r}, "
                             "no 'latest' file?): pass a directory written by save_checkpoint")
        refusal = resume_refusal(path, client_state.get("world_size"), self.world_size,
                                 client_state.get("heldout_threshold", 0),  # 0: from before the split existed
                                 self.heldout_threshold)
        if refusal is not None:
            raise ValueError(refusal)
        self.global_step = int(client_state["global_step"])
        self.tokens_seen = int(client_state["tokens_seen"])
        self.loss_first = client_state.get("loss_first")
        self.loss_last = client_state.get("loss_last")  # what a resume that has no steps left reports
        self.resumed_from_step = self.global_step
        self.batches.load_state_dict(client_state["data_states"][self.rank])
        _set_rng_state(client_state["rng_states"][self.rank])
        logger.info("rank %d resumed from %s at step %d, data position %s", self.rank, path, self.global_step,
                    client_state["data_states"][self.rank])
        return self.global_step

    # -- export ----------------------------------------------------------------------------
    def export(self, out_dir: str | Path) -> Path | None:
        """speculators-format draft for vLLM (see eagle3.train.export). Every rank must call it;
        rank 0 writes and gets the directory, others None."""
        from eagle3.train.export import export_draft

        self._need_engine()
        return export_draft(self.engine, out_dir, self.target_dir, train_config=self.cfg,
                            extra_provenance={"steps": self.global_step, "tokens_seen": self.tokens_seen,
                                              "loss_first": self.loss_first, "loss_last": self.loss_last,
                                              "data_files": list(self.dataset.files)})
