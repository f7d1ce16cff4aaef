from taskloop.cli import main

main()
