"""One forward of SGLang's own model over the tokens a blend chooses (`forward_pass`), and the attention that stands
in for SGLang's backend during it: torch (`sparse_attention`) and FlashInfer's paged prefill on CUDA
(`paged_attention`). Beside them, SGLang's linear layers with prepacked weights on a CPU without AMX
(`packed_linear`), which every forward of the model runs.

Imports no other folder; `scheduler.blend` and `scheduler.auto_chunks` run the forward, the plugin packs the weights.
"""
