"""pinflow's pages in the Airflow UI: the plugin's FastAPI app (:mod:`pinflow_ui.web`), what the pages show
(:mod:`pinflow_ui.pages`) and their server-rendered SVG charts (:mod:`pinflow_ui.svg`).

Airflow imports every ``.py`` file of the plugins folder in every process; ``.airflowignore`` keeps this package
out of that scan, so only the API server imports it (on the first request to ``/pinflow``).
"""
