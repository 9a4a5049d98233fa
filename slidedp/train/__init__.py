"""The `slidedp train` job: config.py, sources.py, arrowdata.py (through Hugging Face datasets) and data.py
(data), schedule.py, metrics.py, job.py, export.py, shapes.py (preset shapes), smollm2.py (the embedded
default model)."""
