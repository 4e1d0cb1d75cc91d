"""Other libraries' interfaces over Claw: PyTorch datasets (``torch``), Stable-Baselines3
replay and rollout buffers (``sb3``), TorchRL storage and samplers (``torchrl``), what
those buffers share (``experience``; their read sizing, ``cadence``), LLM trainers' token
tensors (``llm_trainers``), TRL's ``GRPOTrainer`` rollouts from group batches (``trl``)
and Minari datasets (``minari``). Each is imported on its own: ``torch``, ``torchrl``
and ``trl`` are extras."""
