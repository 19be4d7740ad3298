"""The feature build's steps, one module each with its SQL beside the function that runs it (docs/architecture.md §2–3):
``daily`` → ``window`` → ``sequences`` → ``examples``. ``features.build`` runs them (CLI, ``build_day``, ``build_step``).
"""
