"""The engine: requests in, one step at a time, :class:`StepOutput` out.

:class:`LLMEngine` is the facade that ``dsmesh generate``, the instance services and the
tests use, and the reference that the PD mesh must match. It holds the parts and steps them:

- the model runner (dsmesh/engine/runner/model_runner.py): the model, its KV pool, the
  kernel choice, the decode graphs, one forward of a scheduled step;
- the scheduler (dsmesh/engine/sched/scheduler.py): which requests run and which pages they
  hold;
- the input processor (dsmesh/engine/input_processor.py): a request's inputs validated and
  its state built;
- the output processor (dsmesh/engine/output_processor.py): sampled tokens into request
  state, stop conditions, logprobs, grammars;
- launch-ahead (dsmesh/engine/runner/launch_ahead.py): the next greedy decode step launched
  before this one's bookkeeping;
- the speculative worker (dsmesh/engine/speculative/worker.py), with ``speculative="mtp"``;
- the group lockstep (dsmesh/engine/lockstep.py), as one rank of an expert-parallel group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from dsmesh.engine.derived import check_weights_fit, resolve_engine_config
from dsmesh.engine.input_processor import InputProcessor
from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.engine.lockstep import GroupLockstep, GroupVote
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.config import ModelConfig, load_config
from dsmesh.engine.model.deepseek import DeepseekForCausalLM
from dsmesh.engine.model.mtp import MTPDraft
from dsmesh.engine.options import EngineConfig, resolve_model_dir
from dsmesh.engine.output_processor import OutputProcessor, StepOutput
from dsmesh.engine.request import Request, RequestStatus
from dsmesh.engine.runner.cuda_graph import CudaGraphRunner, GraphCaptureError
from dsmesh.engine.runner.imports_ahead import ImportsAhead, kernel_modules
from dsmesh.engine.runner.launch_ahead import Decoded, LaunchAhead
from dsmesh.engine.runner.model_runner import ModelRunner, scores_prompt
from dsmesh.engine.sampling.grammar import GrammarMasks, GrammarVocab
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.sampler import Sampler, advance_generator
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.engine.sched.load_report import EngineLoad, engine_load
from dsmesh.engine.sched.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from dsmesh.engine.speculative.verifier import SpecStats
from dsmesh.engine.speculative.worker import make_speculator
from dsmesh.engine.startup import StartupClock

__all__ = ["EngineConfig", "GenerationResult", "LLMEngine", "StepOutput"]


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    spec_draft_tokens: int = 0  # tokens drafted for it (speculative decoding)
    spec_accepted_tokens: int = 0  # of which the target accepted


def scheduler_config(config: EngineConfig) -> SchedulerConfig:
    """The scheduler's part of the engine's options."""
    return SchedulerConfig(
        page_size=config.page_size,
        max_running_requests=config.max_running_requests,
        max_batch_tokens=config.max_batch_tokens,
        prefix_cache=config.prefix_cache,
        num_lookahead_tokens=config.num_draft_tokens if config.speculative else 0,
        admit_interval=config.admit_interval,
        contiguous_prompts=config.contiguous_prompts,
    )


class LLMEngine:
    """Continuous-batching generation on one device.

    Output tokens include the token that stopped generation (EOS or a stop token id).
    """

    def __init__(
        self,
        config: EngineConfig,
        model: DeepseekForCausalLM | None = None,
        draft: MTPDraft | None = None,
        startup: StartupClock | None = None,
    ) -> None:
        """``startup``: the clock of this process's start-up, which the engine's phases are
        added to (a caller that loaded ``model`` itself timed its ``weights``)."""
        config.validate()
        self.startup = startup if startup is not None else StartupClock()
        device = config.resolved_device()
        if not config.is_resolved:  # derived defaults (dsmesh/engine/derived.py)
            mc = model.config if model is not None else load_config(resolve_model_dir(config.model))
            config = resolve_engine_config(config, mc, device)
        imports_ahead = None
        if model is None:
            model_dir = resolve_model_dir(config.model)
            model_config = load_config(model_dir)
            check_weights_fit(config, model_config, device)
            # Triton and FlashInfer load on a thread while the weights are read
            imports_ahead = ImportsAhead(kernel_modules(config, device, model_config))
            with self.startup.phase("weights"):
                model = load_model(
                    model_dir,
                    config.resolved_dtype(),
                    device,
                    keep_fp8=bool(config.fp8_experts),
                    fp8_only=True,
                    weights_read=config.weights_read,
                    fp8_linears=bool(config.fp8_linears),
                )
        self.runner = ModelRunner(config, model, device, self.startup, imports_ahead)
        self.scheduler = Scheduler(scheduler_config(config), self.kv_pool.allocator)
        mc = self.model_config
        self.requests: dict[str, Request] = {}
        # structured outputs (dsmesh/engine/sampling/grammar.py): the vocabulary is indexed
        # on the first constrained request
        self.grammar_masks = GrammarMasks(
            self._checkpoint_dir, mc.vocab_size, mc.eos_token_ids, device
        )
        self.input = InputProcessor(
            mc.vocab_size,
            self.max_context,
            config.page_size,
            self.kv_pool.num_pages,
            self.grammar_masks,
            device,
            self.requests,
        )
        sampler = Sampler(mc.eos_token_ids)
        self.output = OutputProcessor(
            self.scheduler, sampler, self.grammar_masks, mc.eos_token_ids, self.requests
        )
        self.launch_ahead = LaunchAhead(self.runner, self.scheduler, self.grammar_masks)
        with self.startup.phase("speculative") if config.speculative else nullcontext():
            self.speculator = make_speculator(config, self.runner, self.scheduler, sampler, draft)
        self.lockstep: GroupLockstep | None = None  # expert parallelism: see join_group

    def _checkpoint_dir(self) -> Path:
        return resolve_model_dir(self.config.model)

    # ---- the parts' state, as the engine's ----------------------------------------------

    @property
    def config(self) -> EngineConfig:
        return self.runner.config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        """Options for the next steps (benchmarks' A/B runs): tbo, overlap_decode, ...;
        kernels are chosen again only by :meth:`switch_kernels`."""
        self.runner.config = config

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def model(self) -> DeepseekForCausalLM:
        return self.runner.model

    @property
    def model_config(self) -> ModelConfig:
        return self.runner.model_config

    @property
    def kv_pool(self) -> MLAKVPool:
        return self.runner.kv_pool

    @property
    def graph_runner(self) -> CudaGraphRunner | None:
        """The decode graphs (None: every step runs eagerly)."""
        return self.runner.graph_runner

    @graph_runner.setter
    def graph_runner(self, runner: CudaGraphRunner | None) -> None:
        self.runner.graph_runner = runner

    @property
    def sampler(self) -> Sampler:
        return self.output.sampler

    @sampler.setter
    def sampler(self, sampler: Sampler) -> None:
        self.output.sampler = sampler

    @property
    def draft(self) -> MTPDraft | None:
        """The MTP draft model, when the engine speculates."""
        return None if self.speculator is None else self.speculator.draft_model

    @property
    def spec_stats(self) -> SpecStats | None:
        """Speculative decoding counters, or None when the engine does not speculate."""
        return None if self.speculator is None else self.speculator.stats()

    @property
    def num_launched_ahead(self) -> int:
        """Decode steps launched before the previous one's end (overlapped decode)."""
        return self.launch_ahead.num_launched_ahead

    @property
    def num_split_steps(self) -> int:
        """Mixed steps run as a decode graph + an eager forward."""
        return self.runner.num_split_steps

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    # ---- configuration --------------------------------------------------------------------

    def join_group(self, vote: GroupVote) -> None:
        """Make this engine one rank of an expert-parallel group whose MoE collectives pair
        up across ranks: before each step the ranks agree, through ``vote``, on its decode
        graphs, its speculative forwards and launching the next step ahead
        (dsmesh/engine/lockstep.py); a rank with nothing to run replays one row over a page
        of its own, and pads the draft forwards of a step where another rank speculates."""
        self.lockstep = GroupLockstep(vote, self.runner, self.speculator)
        idle_page = self.runner.join_group()
        self.launch_ahead.vote = self.lockstep.agree_on_launch
        if self.speculator is not None:
            self.speculator.join_group(idle_page)

    def switch_kernels(self, **changes: str) -> None:
        """Choose kernels again with ``changes`` to the config's ``kernels``,
        ``decode_attention`` or ``moe_backend`` (A/B runs in benchmarks); captured graphs
        are dropped and recaptured on use."""
        allowed = {"kernels", "decode_attention", "moe_backend"}
        if not set(changes) <= allowed:
            raise ValueError(f"switch_kernels takes {sorted(allowed)}, got {sorted(changes)}")
        config = dataclasses.replace(self.config, **changes)
        config.validate()
        self.runner.switch_kernels(config)
        if self.speculator is not None:
            self.speculator.reset_graphs()

    # ---- requests -------------------------------------------------------------------------

    def make_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        prefill_only: bool = False,
    ) -> Request:
        """Validate inputs and build a request (not yet queued; InputProcessor)."""
        return self.input.make_request(prompt_ids, params, request_id, prefill_only)

    def grammar_vocab(self) -> GrammarVocab:
        """The tokenizer's vocabulary for grammar matchers, indexed on first use (about a
        second for DeepSeek-V3's); InvalidRequestError when the checkpoint has no
        ``tokenizer.json``."""
        return self.grammar_masks.vocab()

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        prefill_only: bool = False,
    ) -> str:
        """Queue a request. With ``prefill_only`` it finishes ("prefilled") after its first
        token and keeps its pages until :meth:`release`, so its KV can be sent elsewhere."""
        req = self.make_request(prompt_ids, params, request_id, prefill_only)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    def reserve(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str
    ) -> Request:
        """Validate and take pages now for a request whose prompt KV will be written into
        them by someone else (decode instance): its prompt's pages (``Scheduler.reserve``).
        Until :meth:`activate` it is not running, so never retracted while the KV arrives;
        then it takes pages as its tokens need them, and a retraction recomputes prompt and
        output here. Raises OutOfPagesError when short."""
        req = self.make_request(prompt_ids, params, request_id)
        self.launch_ahead.settle()  # its pages: no KV write of a launched step pending
        self.scheduler.reserve(req)
        self.requests[req.request_id] = req
        return req

    def activate(
        self,
        request_id: str,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        draft_token_ids: Sequence[int] = (),
    ) -> StepOutput:
        """The prompt KV of a reserved request is in its pages and ``first_token`` was sampled
        elsewhere (with ``first_logprobs``, when the request asks for logprobs): continue
        decoding from there (or finish if that token ends it). ``draft_token_ids``: the
        tokens the prefill instance drafted after ``first_token`` (:meth:`handoff_drafts`),
        which the first speculative step verifies."""
        req = self.requests[request_id]
        tok = int(first_token)
        req.num_computed = len(req.prompt_ids)
        if req.generator is not None and req.params.temperature > 0:
            advance_generator(req.generator, 1)  # the first draw happened on prefill
        req.output_ids.append(tok)
        # Prefill's matcher took the first token there; this one, built from the same spec
        # at reserve(), replays it so the grammar state continues here.
        self.output.advance_grammar(req, tok)
        self.scheduler.start_reserved(req)
        if self.speculator is not None:
            self.speculator.take_handoff_drafts(req, draft_token_ids)
        return self.output.first_token(req, tok, first_logprobs)

    def handoff_drafts(self, request_id: str) -> list[int]:
        """The tokens a speculating engine drafted after a ``prefill_only`` request's first
        token, for the decode instance to verify in its first step (greedy requests; empty
        for others and without speculation). Read before :meth:`release`."""
        req = self.requests.get(request_id)
        if self.speculator is None or req is None:
            return []
        return self.speculator.handoff_drafts(req)

    def release(self, request_id: str) -> None:
        """Give back the pages a finished ``prefill_only`` request kept."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req.status is not RequestStatus.FINISHED:
            self.scheduler.finish(req, "abort")
        self.scheduler.release_pages(req)

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages; False if it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.FINISHED:
            self.scheduler.release_pages(req)  # a prefilled request still holding pages
            return False
        req.keep_pages = False
        self.scheduler.finish(req, "abort")
        return True

    @property
    def num_pages_in_use(self) -> int:
        """Pages held for requests (not the one join_group keeps for idle graph steps)."""
        return self.scheduler.num_pages_in_use - len(self.runner.idle_page)

    @property
    def stats(self) -> SchedulerStats:
        """Scheduling counters (retractions) since the engine started, for metrics."""
        return self.scheduler.stats()

    def load(self) -> EngineLoad:
        """What this engine holds now: pages, running and queued requests (for load reports
        and metrics; safe to call from another thread)."""
        # the page join_group keeps for idle graph steps is neither free nor a request's
        return engine_load(self.scheduler, self.kv_pool.num_pages - len(self.runner.idle_page))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def capture_deferred_graph(self) -> bool:
        """Between steps: capture one decode graph queued for after ready, if one is due
        (dsmesh/engine/runner/graph_schedule.py: any while no request is in the engine, else
        one that steps keep needing). Never while a step launched ahead reads the graph
        buffers, nor in an expert-parallel group (whose ranks capture all before ready)."""
        if self.lockstep is not None or self.launch_ahead.inflight is not None:
            return False
        return self.runner.capture_deferred_graph(idle=not self.has_unfinished())

    # ---- stepping -------------------------------------------------------------------------

    def step(self, idle_forward: bool = False) -> list[StepOutput]:
        """Run one forward over everything scheduled and sample where a token is due.

        With ``idle_forward`` a rank with nothing scheduled still runs an empty forward, so
        it joins the expert-parallel collectives of the step.

        With ``overlap_decode`` a greedy decode step may already have been launched by the
        previous call (its inputs are that call's tokens, still on the device); this call
        then finishes it, after launching the one after it when that is certain too.
        """
        ahead = self.launch_ahead
        if ahead.inflight is not None:
            decoded = ahead.finish()
            if decoded is not None:
                return self._book_decoded(decoded)
        chunks = self.scheduler.schedule()
        spec = self.speculator
        speculates = spec is not None and spec.speculates(chunks)
        group = self.lockstep
        bucket = None if group is None else group.agree_on_graphs(chunks, speculates)
        if not chunks:
            if idle_forward and bucket is not None:
                assert group is not None
                group.idle_graph_step(bucket)
                group.decline_launch_ahead(bucket)
            elif idle_forward:
                self.runner.idle_forward()
            return self._pad_group_drafts([])
        if speculates:
            assert spec is not None
            return self._pad_group_drafts(spec.step(chunks, self.output))
        if ahead.can_launch(chunks) and (group is None or group.may_launch_ahead(bucket)):
            return self._decode_ahead([c.request for c in chunks], bucket)
        if any(scores_prompt(c) for c in chunks):
            logits, scored = self.runner.forward_scoring(chunks)
        else:
            logits, scored = self.runner.forward(chunks, bucket), {}
            if group is not None:
                group.decline_launch_ahead(bucket)
        return self._pad_group_drafts(self.output.process(chunks, logits, scored))

    def _pad_group_drafts(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """In a group whose step speculates somewhere: this rank's draft forwards up to the
        group's count (join_group); then the step's ``outputs``."""
        if self.lockstep is not None:
            self.lockstep.pad_drafts()
        return outputs

    def _decode_ahead(
        self, reqs: list[Request], bucket: tuple[int, int] | None
    ) -> list[StepOutput]:
        """A greedy decode step on the graphs that launches the next one ahead."""
        try:
            decoded = self.launch_ahead.decode(reqs, bucket)
        except GraphCaptureError:
            self.runner.drop_graphs()
            return self.step()  # the same schedule again (nothing was consumed)
        return self._book_decoded(decoded)

    def _book_decoded(self, decoded: list[Decoded]) -> list[StepOutput]:
        return [self.output.book_token(req, tok, computed) for req, tok, computed in decoded]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Run all prompts together as one continuous batch; results in input order."""
        if params is None:
            params = SamplingParams()
        per = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        reqs = [self.make_request(p, sp) for p, sp in zip(prompts, per, strict=True)]
        for r in reqs:
            self.requests[r.request_id] = r
            self.scheduler.add(r)
        while any(r.status is not RequestStatus.FINISHED for r in reqs):
            self.step()
        return [
            GenerationResult(
                r.request_id,
                r.prompt_ids,
                r.output_ids,
                r.finish_reason or "",
                r.num_spec_draft_tokens,
                r.num_spec_accepted_tokens,
            )
            for r in reqs
        ]
