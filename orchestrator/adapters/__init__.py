"""Other libraries' interfaces over Claw: PyTorch datasets (``torch``), Stable-Baselines3
replay and rollout buffers (``sb3``), TorchRL storage and samplers (``torchrl``), RLlib
episode replay buffers (``rllib``), LLM trainers' token tensors (``llm_trainers``), TRL's
``GRPOTrainer`` rollouts from group batches (``trl``) and Minari datasets (``minari``).
What the replay buffers share, one noun a module: ``transitions`` (streams written as
episodes), ``link`` (what a buffer holds open on a namespace), ``parts`` (a batch as the
samples it serves), ``versions`` (the policy version a sample trains), ``cadence`` (read
sizes), ``defaults`` (seed, ingest options, a reset's namespace) and ``urls`` (saved
without a password). Each is imported on its own: ``torch``, ``torchrl``, ``rllib`` and
``trl`` are extras."""
