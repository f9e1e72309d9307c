from ds4py.cli import main

main()
