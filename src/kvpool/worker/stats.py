"""A worker rank's counters: every stage of the save and load paths adds to them, the adapter publishes them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerStats:
    save_jobs: int = 0  # save batches: one per engine step with new chunks
    save_jobs_dropped: int = 0
    chunks_examined: int = 0
    chunks_already_present: int = 0
    chunks_put: int = 0
    put_calls: int = 0  # backend put calls: a remote pool's cost is mostly per call
    chunks_put_failed: int = 0  # chunks not stored, counted once each whatever the retries
    full_retries: int = 0  # puts asked again because the pool answered full (it evicts in the background)
    chunks_unreadable: int = 0  # null or freed blocks: nothing to save
    bytes_put: int = 0
    bytes_captured: int = 0  # copied out of the engine's blocks for the sender
    loads: int = 0
    chunks_loaded: int = 0
    chunks_load_failed: int = 0
    loads_timed_out: int = 0  # loads still reading past their deadline: reported failed, recomputed
    loads_in_step: int = 0  # contract hits loaded before the forward of the step that scheduled them
    in_step_load_failures: int = 0  # in-step loads that did not fully load: the hit contract broke (never expected)
    chunks_corrupt: int = 0  # loaded chunks whose seal did not match (failed, recomputed, dropped)
    bytes_loaded: int = 0
    pressure_events: int = 0
    resets: int = 0
