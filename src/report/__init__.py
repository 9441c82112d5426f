"""``python -m src.report``: tables, figures and paired effects of a sweep's runs, from MLflow."""
