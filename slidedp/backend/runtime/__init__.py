"""Running a Program: executor.py interprets its ops on streams.py; routes.py moves weights and
gradients; rank.py is one rank's step; workers.py and comm.py the ranks' processes and collectives;
update_stream.py, early_updates.py, streamed_updates.py the optimizer updates; saved_activations.py
and embedding_grads.py what blocks and the prologue keep for their backward."""
