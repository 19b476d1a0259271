"""What tests/test_receipt_snippets.py runs around docs/how-it-works.md's receipt apps: a Django
project, Flask's runner, and the faults it stages (WSGI and node), each in the app's process."""
