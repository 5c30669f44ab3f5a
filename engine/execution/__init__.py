"""Running a scheduled batch on the device: the model runner that owns the model, its KV
cache and graphs (``model_runner.py``); a batch packed into one step's device inputs
(``batch.py``, through ``pinned_inputs.py``); CUDA graphs of decode, verify and prompt steps
(``cuda_graphs.py``, ``prompt_graphs.py``); and the start-up warm-up (``warm_up.py``)."""
