"""Built-in English text: calibration for GPTQ/AWQ (no downloads) and a separate, fixed sample for
perplexity checks. Written for this project; the two sets share no sentences."""

CALIBRATION = [
    "The river begins as a thin stream high in the mountains, fed by snow that melts a little every "
    "afternoon. By the time it reaches the valley it is wide and slow, and the farmers who live along "
    "its banks have learned to read its moods. In spring they watch the water rise and move their "
    "animals to higher ground; in late summer they open small channels to carry it into the fields.",

    "To make a simple bread, mix five hundred grams of flour with ten grams of salt, seven grams of dry "
    "yeast and about three hundred and fifty milliliters of warm water. Knead the dough for ten minutes "
    "until it is smooth, cover it, and let it rise for an hour. Shape it into a loaf, let it rise again, "
    "and bake it at two hundred and twenty degrees until the crust is deep brown and sounds hollow.",

    "A function in a program is a named piece of code that takes some inputs and returns a result. "
    "Good functions do one thing, have clear names, and avoid changing state that the caller does not "
    "expect. When a function grows too long, it is usually a sign that it is doing several jobs at once "
    "and should be split into smaller pieces that can be tested on their own.",

    "In the eighteenth century, most goods crossed the ocean on wooden sailing ships that depended on "
    "the wind. A voyage from Europe to the Americas could take six weeks or more, and captains planned "
    "their routes around the trade winds and the seasons. The arrival of steam engines in the next "
    "century made travel faster and more predictable, and it changed the economy of every port city.",

    "Photosynthesis is the process by which plants use light to turn carbon dioxide and water into "
    "sugar and oxygen. It takes place mainly in the leaves, inside small structures called "
    "chloroplasts, which contain the green pigment chlorophyll. The sugar feeds the plant and, through "
    "the food chain, almost every other living thing on land.",

    "\"Are you coming to the meeting tomorrow?\" asked Maria. \"I think so,\" said Tom, \"but I might be "
    "a few minutes late. My train usually arrives at half past eight, and the office is a short walk "
    "from the station.\" \"That's fine,\" she replied. \"We will start with the budget and leave the "
    "schedule for the end, so you won't miss anything important.\"",

    "The human heart beats around one hundred thousand times a day. It has four chambers: two atria "
    "that receive blood and two ventricles that pump it out. The right side sends blood to the lungs, "
    "where it picks up oxygen, and the left side pushes that oxygen-rich blood through the arteries to "
    "the rest of the body. Regular exercise makes the heart muscle stronger and more efficient.",

    "When you travel to a new city, it helps to walk. Buses and taxis are quick, but on foot you notice "
    "the small shops, the smell of a bakery in the morning, the way people greet each other in the "
    "street. Many travelers say that their best memories come from getting a little lost and finding "
    "a quiet square or a market that was not in any guidebook.",

    "Interest is the price of borrowing money. If you put one thousand dollars in a savings account "
    "that pays five percent a year, you will have one thousand and fifty dollars after twelve months. "
    "If the interest is compounded, the next year you earn interest on the interest as well, which is "
    "why small differences in the rate matter a great deal over long periods of time.",

    "The old library had tall windows and long wooden tables, and in the afternoon the light fell "
    "across the rows of books in wide golden bands. Students came to study in silence, and the only "
    "sounds were the turning of pages and the soft steps of the librarian, who seemed to know where "
    "every volume was kept without ever looking at the catalog.",

    "To reset the device, hold the power button for ten seconds until the light blinks twice. Release "
    "the button and wait for the light to turn solid green. If the light turns red instead, unplug the "
    "device, wait one minute, and try again. Your settings will be erased, so write down your network "
    "name and password before you begin.",

    "Volcanoes form where molten rock from deep inside the earth finds a way to the surface. Some, like "
    "those in Hawaii, release lava slowly and build wide, gentle mountains over thousands of years. "
    "Others explode violently, throwing ash high into the atmosphere, where it can travel around the "
    "world and even cool the climate for a year or two.",

    "The committee reviewed the proposal carefully and agreed that the project was worth pursuing, but "
    "it asked the team to reduce the cost by ten percent and to provide a clearer plan for the second "
    "phase. A revised version will be presented next month, after the engineers have finished testing "
    "the new materials and the finance office has checked the estimates.",

    "Learning a musical instrument takes patience. At first the fingers feel clumsy and the sounds are "
    "harsh, but with daily practice the movements become automatic and the mind is free to listen. "
    "Teachers often say that twenty minutes every day is better than two hours once a week, because the "
    "brain needs time and repetition to build new habits.",

    "A database stores information in tables made of rows and columns. Each row describes one item, "
    "such as a customer or an order, and each column holds one property of that item. Queries let you "
    "select the rows you need, join tables that share a key, and sort or group the results, which makes "
    "it possible to answer questions about millions of records in a fraction of a second.",

    "The first snow of the year arrived quietly during the night. In the morning the roofs were white, "
    "the cars were buried up to their windows, and the children ran outside before breakfast to build "
    "a snowman. Their parents stood at the door with cups of coffee, watching, and trying to remember "
    "where they had put the shovel last winter.",
]

# held out from calibration: what perplexity is measured on
EVAL = [
    "Bees communicate the location of flowers to the rest of the hive with a kind of dance. A worker "
    "that has found a good source of nectar returns and moves in a figure-eight pattern, and the angle "
    "of the straight part of the dance tells the others the direction of the flowers relative to the "
    "sun, while the length of the dance tells them how far away the flowers are.",

    "The town council voted on Tuesday to build a new public swimming pool next to the school. The "
    "project will be paid for partly by a national grant and partly by the town's own budget, and "
    "construction is expected to start in the autumn. Several residents spoke at the meeting, most of "
    "them in favor, although some worried about traffic and parking near the site.",

    "If you want to keep a plant healthy indoors, place it near a window where it gets bright but "
    "indirect light, and water it only when the top few centimeters of soil feel dry. Too much water "
    "is a more common problem than too little, because the roots need air as well as moisture. Turn "
    "the pot every week or two so that the plant grows evenly instead of leaning toward the glass.",

    "The museum's new exhibition tells the story of writing, from the first marks pressed into clay "
    "tablets to the printing press and the computer screen. Visitors can try to write their names in "
    "ancient scripts, watch a craftsman set metal type by hand, and see how the shape of letters "
    "changed as people moved from brushes and reeds to pens and keyboards.",

    "Sleep is not simply a pause in the day. While we sleep, the brain sorts through what happened, "
    "strengthens some memories and lets others fade, and the body repairs tissue and balances its "
    "hormones. Adults who regularly sleep less than six hours a night are more likely to have trouble "
    "concentrating, and over time they face a higher risk of several long-term illnesses.",
]
