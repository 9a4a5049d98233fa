"""What the benchmark harnesses share: the model and data every system trains (`model`), host-memory
sampling (`hostmem`), the systems themselves in one child process (`systems`: slidedp, GPU-resident
PyTorch, FSDP2), child processes with a timeout (`child`), records and their git stamp (`records`),
command-line options (`cli`) and Markdown tables (`tables`)."""
