"""Training drafts for a target: ``specdec distill`` (layer drafts and EAGLE-style drafts), their data and schedules.

Inference never imports this package: the EAGLE draft model lives in ``specdec.models.eagle``, draft folders load
through ``specdec.loading`` (``draft_folder``, ``eagle_folder``, ``default_draft``).
"""
