"""The job and its sections, each a frozen dataclass whose fields carry their flags: the model
(`model`), the optimizer (`optim`), the learning-rate schedule (`lr_schedule`), the data (`data`), the
architecture flags (`arch`), the autotune (`autotune`), and the job that holds them with its layout
(`job`). Pure: no torch."""
