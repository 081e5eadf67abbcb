"""Helpers for the browser UI test (tests/test_ui_browser.py): a stdlib CDP client and an mlflow server runner."""
