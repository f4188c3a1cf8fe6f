"""The models a worker trains and how they run: presets and Hugging Face models, losses, stacked workers,
mixed precision and compilation."""
