from kxpu.cli import main

main()
