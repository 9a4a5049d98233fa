"""Running a Program: executor.py interprets its ops (on streams.py's streams) and hands each to its
part: weight_slots.py (the window's device slots), prologue.py, block_runner.py (a block's forward
and backward under its activation policy; grad_buffers.py its fp32 gradient buffers), epilogue.py
(head and loss), pass_gradients.py (gradient accumulation and copy-out), pass_state.py (one pass's
state). routes.py moves weights and gradients; rank.py is one rank's step; workers.py and comm.py the ranks' processes and collectives;
update_stream.py, early_updates.py and streamed_updates.py the optimizer updates;
saved_activations.py and embedding_grads.py what blocks and the prologue keep for their backward."""
