from lnfree.cli import app

app()
