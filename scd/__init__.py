"""scd: a crash-consistent single controller for asynchronous RL post-training.

Layering, bottom to top (a module imports only from layers below it):

1. ``config``, ``errors``, ``records``, ``tasks``, ``triggers``: typed configuration,
   error types with exit codes, plain records, the tasks' prompts and answers
   (built-in, or rows of a JSONL or Parquet file), and what signals ask of a
   running controller.  No I/O beyond reading the config and task files.
2. Controller state, pure parts: ``ledger`` (prompt lifecycle), ``replay``
   (metadata index of ready groups), ``samplers`` (which groups a train step
   may take), ``dataloader`` (seeded prompt order with a cursor), ``barrier``
   (the shared/exclusive checkpoint lock), ``schema`` (the bundle format and
   the checkpoint vocabulary as typed structs), ``skew`` (prompt buckets, each
   prompt's fate counted per bucket).  Then ``state``: those parts
   together and the only code that mutates them, each mutation under the
   barrier; TQ rows are written through a protocol handed in.
3. ``model``: the seam trainer and generation share (the policy: tokenizer,
   model, weights; weights as layer-sized chunks; the tiny models; the task's
   prompts rendered once to the token ids both see).
4. Adapters to the outside world: ``cluster`` (the Ray scd runs on, and the
   device plan: what the trainer ranks and engines get), ``dataplane``
   (TransferQueue on Ray, every call bounded), ``training`` (GRPO, and the
   trainer as FSDP2 ranks on Ray; ``training.loss``, ``training.schedule`` and
   ``training.dcp_state``, the loss options, LR schedules and sharded trainer
   state, are tested building blocks the trainer does not call yet), ``generation`` (torch, vLLM or the synthetic
   load-testing engine; weight sync), ``telemetry`` (Prometheus, typed events,
   experiment trackers), ``rewards`` (what a completion scores: built-ins and the
   user's sync functions in worker processes, async ones on the loop, a remote
   scorer over HTTP, every call bounded), ``systemd`` (sd_notify), ``reaper`` (a process of its
   own, standard library only, that kills the embedded Ray's processes when scd
   dies).  Generation and training never import each other: they meet in
   ``model``.
5. ``rollouts``: a group's life from admission to commit (requests, finished
   siblings and their staging, scoring, the committer, paced admission) and its
   half of a checkpoint cut (``capture``/``restore``); it wakes the pumps
   through a callback and never sees the controller or the checkpointer.
   ``goodput``: how busy generation is, its bound, what it wastes; it reads the
   rollouts, the token counter and each train step, never the controller.
   ``risk``: the loss window, what a crash now would lose.  ``scoring``: the stage
   between generation and commit that scores each finished sibling once with the
   rewards, and waits out a reward service's outage; the rollouts own it.
6. ``checkpoint``: the bundle layout, save, restore and offline verify.  It
   works on the state, the data plane, the trainer and the rollouts, never the
   controller; restore is one path from bundle to the first admission.
   ``evaluation``: held-out evaluation at step boundaries, and of a bundle
   offline (``scd eval``); it never touches the replay buffer or the ledger.
7. ``daemon``: wiring, the pumps, and the one task group in which every
   concurrent activity runs.  ``watch``: observing it (/healthz, gauges,
   step rates, stalls, the loop probe, the telemetry sampler).
8. ``cli``: argument parsing and exit codes.  ``report``: the offline report
   over the event log.

``tests/test_layering.py`` checks this order: no import runs up a layer, and
no import circle.
"""

__version__ = "0.1.0"
