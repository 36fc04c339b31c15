"""Examples that exercise the whole stack: a small GPT (dense and MoE), a synthetic task, and
the FSDP training job (``python -m ragged train`` / ``torchrun -m ragged.examples.train``)."""
