"""What ``specdec bench`` measures and reports: prompt sets (``data``), transformers baselines (``hf``),
divergence analysis (``divergence``), the report and its tables (``report``), the batch-size sweep
(``sweep``) and plots (``plot``)."""
