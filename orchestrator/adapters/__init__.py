"""Other libraries' interfaces over Claw: PyTorch datasets (``torch``), Stable-Baselines3
replay buffers (``sb3``), TorchRL storage and samplers (``torchrl``), what those buffers
share (``experience``), LLM trainers' token tensors (``llm_trainers``) and Minari datasets
(``minari``). Each is imported on its own: ``torch`` and ``torchrl`` are extras."""
