"""lkcnn.training.callbacks: Lightning callbacks (per-layer kernel timing, throughput, the progress bar, the run
summary) and the Hydra callback that finishes each job's W&B run."""
