"""Stage 1, model -> IR: the layer graph of a model (prologue, blocks, epilogue), free of torch objects.

graph.py          the IR: Layer, LayerCosts, LayerGraph (frozen data)
build.py          build_layer_graph: trace a module on fake tensors into a LayerGraph
blocks.py         finding the blocks; standing in for them while the model's own forward runs
export_trace.py   the torch.fx view (torch.export) grouped into prologue / blocks / epilogue
compiled_saved.py what a torch.compile'd block saves for its backward
"""
