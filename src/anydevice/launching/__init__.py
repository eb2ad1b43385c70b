"""Launching: one process per device on one or many machines, watched until they end.

``ad.launch`` and ``anydevice launch`` start the workers through torch's elastic agent;
the launcher's side inside each worker (running the script, recording its failure, the
hang watch's rank side) is here too. Nothing here imports the training side
(:mod:`anydevice.training`), which reads this package's :mod:`.environment`,
:mod:`.failures` and :mod:`.progress` from above.

* :mod:`~anydevice.launching.environment` — which launcher started this process (pure).
* :mod:`~anydevice.launching.elastic` — ``launch()`` through torch's elastic agent.
* :mod:`~anydevice.launching.arguments` — what ``launch()`` takes, checked before it starts.
* :mod:`~anydevice.launching.options` — ``LaunchOptions``: what a launch is asked for;
  ``LaunchPlan``: what the agent is given, pure data.
* :mod:`~anydevice.launching.preflight` — what would break the workers as they start (a
  missing main guard, a notebook's function under ``spawn``), refused before any starts.
* :mod:`~anydevice.launching.agent` — torch's agent run for a launch, under faults.
* :mod:`~anydevice.launching.rendezvous` — where the nodes meet, every wait bounded.
* :mod:`~anydevice.launching.addressing` — the address of this node the others reach.
* :mod:`~anydevice.launching.tenants` — the runs that share a rendezvous store: another
  run id named.
* :mod:`~anydevice.launching.reaper` — every process the workers start ends with the launch.
* :mod:`~anydevice.launching.runner` — how ``anydevice launch`` runs a script per worker.
* :mod:`~anydevice.launching.output` — a worker's output in whole lines.
* :mod:`~anydevice.launching.failures` — which worker's failure is the root cause.
* :mod:`~anydevice.launching.hangwatch` — the launcher's hang watch: every rank's state,
  one verdict when the job makes no progress.
* :mod:`~anydevice.launching.verdict` — the verdict's rules (mismatch, deadlock, gone,
  stall), pure.
* :mod:`~anydevice.launching.progress` — a rank's side: the collective it is in, from
  torch's flight recorder, published in its heartbeat.

Importing this package imports nothing: torch's elastic agent is imported when a launch
starts.
"""
