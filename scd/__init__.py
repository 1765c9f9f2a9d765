"""scd: a crash-consistent single controller for asynchronous RL post-training.

Layering, bottom to top (a module imports only from layers below it):

1. ``config``, ``errors``, ``records``: typed configuration, error types with
   exit codes, and plain records.  No I/O beyond reading the config file.
2. Pure controller state: ``ledger`` (prompt lifecycle), ``replay`` (metadata
   index of ready groups), ``samplers`` (which groups a train step may take),
   ``dataloader`` (seeded prompt order with a cursor), ``barrier`` (the
   shared/exclusive checkpoint lock).  No awaits on the outside world.
3. Adapters to the outside world: ``dataplane`` (TransferQueue on Ray, every
   call bounded), ``generation`` (torch or vLLM), ``training`` (policy and
   GRPO), ``telemetry`` (Prometheus, events), ``systemd`` (sd_notify).
4. ``checkpoint``: the bundle layout, save, restore and offline verify.
5. ``daemon``: the one task group in which every concurrent activity runs.
6. ``cli``: argument parsing and exit codes.
"""

__version__ = "0.1.0"
