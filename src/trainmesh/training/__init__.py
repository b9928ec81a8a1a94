"""What one optimizer step is made of, whatever the layout: the engine contract every data-parallel form
fulfils (:mod:`.engine`), the loss as a mean over trained tokens (:mod:`.loss`), AdamW with clipping by the whole model's norm (:mod:`.optim`), mixed precision and
fp16 loss scaling (:mod:`.precision`), float8 linears (:mod:`.float8`), bytes per element of model state
(:mod:`.state_bytes`) and CUDA-graph capture of compiled blocks (:mod:`.cuda_graphs`)."""
